"""The README is a front door and docs/ a MkDocs site whose command reference comes from the CLI.

These check what a reader meets: the README's length and links, what it says near the top a
multi-host run needs, every page the site's nav names, no history narration in any page, a
reference page that carries every subcommand's usage line as the CLI prints it, an
environment-variable page that names every DTRUN_* variable the code reads (and no other),
and a runtime API page that names every public name of ``dtrun.collectives``. `make docs`
(mkdocs build --strict) checks the links between pages; it needs the docs extra, so it runs
in CI rather than here.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

import dtrun.collectives
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


# A DTRUN_* name in code or docs (``_DTRUN_COMPLETE``, the completion script's, included).
ENV_NAME = re.compile(r"(?<![A-Za-z0-9_])_?DTRUN_[A-Z0-9_]*[A-Z0-9]")
# The folders that install as dtrun's packages (pyproject.toml's package-dir).
PACKAGE_DIRS = ("dtrun", "launcher", "checks", "collectives")


def _package_dirs() -> list[Path]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    dirs = re.findall(r'^"[^"]+"\s*=\s*"([^"]+)"', section, re.MULTILINE)
    assert set(PACKAGE_DIRS) <= set(dirs), dirs
    return [ROOT / d for d in dirs]


def env_names_in_code() -> set[str]:
    """Every DTRUN_* name the installed packages' sources mention (Python and C)."""
    names = set()
    for top in _package_dirs():
        for path in [*top.rglob("*.py"), *top.rglob("*.c")]:
            names |= set(ENV_NAME.findall(path.read_text(errors="replace")))
    return names


def env_names_on_page(text: str) -> set[str]:
    """The DTRUN_* names a page lists, each in backticks as a whole name."""
    return {m for m in re.findall(r"`(_?DTRUN_[A-Z0-9_]*[A-Z0-9])`", text)}


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


def test_readme_says_what_a_multihost_run_needs_near_the_top():
    top = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    for words in ("same\nabsolute path", "no prompt", "known_hosts", "dtrun keyscan", "dtrun doctor"):
        assert words.replace("\n", " ") in top.replace("\n", " "), words


def test_environment_page_lists_every_variable_the_code_reads():
    in_code = env_names_in_code()
    assert {"DTRUN_RANK", "DTRUN_CHECK", "DTRUN_SSH_CONFIG", "DTRUN_JOB_DIR"} <= in_code
    on_page = env_names_on_page((DOCS / "environment.md").read_text())
    assert sorted(in_code - on_page) == [], "add these to docs/environment.md"
    assert sorted(on_page - in_code) == [], "docs/environment.md lists variables no code reads"


def test_environment_check_fails_when_a_variable_is_missing():
    page = (DOCS / "environment.md").read_text()
    without = page.replace("`DTRUN_SHM_CHUNK`", "DTRUN_SHM_CHUNK")
    assert "DTRUN_SHM_CHUNK" in env_names_in_code() - env_names_on_page(without)
    assert "DTRUN_SHM" in env_names_on_page(without)  # a longer name does not count for a shorter one


def test_runtime_api_page_names_every_public_name():
    page = (DOCS / "runtime-api.md").read_text()
    missing = [n for n in dtrun.collectives.__all__ if not re.search(rf"`{re.escape(n)}\b", page)]
    assert missing == []
