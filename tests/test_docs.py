"""The README is a front door and docs/ a MkDocs site whose command reference comes from the CLI.

These check what a reader meets: the README's length and links, every page the site's nav
names, no history narration in any page, and a reference page that carries every
subcommand's usage line as the CLI prints it. `make docs` (mkdocs build --strict) checks the
links between pages; it needs the docs extra, so it runs in CI rather than here.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

from dtrun.launcher.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATED = {"reference.md"}  # made by docs/hooks.py at build time, never a file in the tree

# History narration, not the product's own sessions (an ssh session, a Slurm session,
# Open MPI's session directories, a pytest session).
HISTORY = re.compile(r"\b(?:this|last|previous|that|an earlier|the next) session\b"
                     r"|\bsessions? ago\b|\bin (?:this|an earlier) session\b"
                     # and who did what when: a change log in prose, one run's machine load
                     r"|\bthis change\b|\bchanges this time\b|\bI tried\b|\bload average [\d.]+ before\b",
                     re.IGNORECASE)


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _mkdocs_config() -> dict:
    # mkdocs.yml is plain YAML (no !!python tags), so the safe loader reads it.
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_reference", DOCS / "gen_cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert any(t.startswith("docs/") for t in targets), "README links into docs/"
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert missing == []


def test_every_nav_page_exists_and_every_page_is_in_nav():
    config = _mkdocs_config()
    assert config["theme"]["name"] == "material"
    assert "docs/hooks.py" in config["hooks"]
    nav = _nav_pages(config["nav"])
    on_disk = {p.name for p in DOCS.glob("*.md")}
    assert [p for p in nav if p not in on_disk and p not in GENERATED] == []
    assert sorted(on_disk - set(nav)) == []
    assert GENERATED <= set(nav)
    assert not (DOCS / "reference.md").exists(), "the reference is generated at build time"


def test_no_page_narrates_history():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in pages for n, line in enumerate(p.read_text().splitlines(), 1)
             if HISTORY.search(line)]
    assert found == []


def test_history_pattern_spares_product_words():
    assert HISTORY.search("as we saw two sessions ago") and HISTORY.search("This session adds")
    assert HISTORY.search("No GPU was lent for this change") and HISTORY.search("load average 1.4 before")
    assert not HISTORY.search("mpirun runs in its own session; Open MPI's session directory")
    assert not HISTORY.search("an ssh session, a Slurm session, after a test session")


def test_reference_has_every_subcommands_usage_line():
    page = _generator().render()
    assert re.search(r"^Usage: dtrun \[OPTIONS\] \[PROGRAM", page, re.MULTILINE)
    for sub in SUBCOMMANDS:
        assert re.search(rf"^usage: dtrun {sub}\b", page, re.MULTILINE | re.IGNORECASE), sub
        assert f"## dtrun {sub}\n" in page
