"""Dependencies run one way: a test that reads every import with ``ast``.

* ``launcher/`` never imports ``checks/`` (``launcher/cli.py``, the top of the program,
  may import everything);
* ``collectives/`` (the runtime on every rank) imports neither ``launcher/`` nor ``checks/``.

Imports inside functions count too: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("launcher", "checks", "collectives")
FORBIDDEN = {"launcher": {"checks"}, "checks": set(), "collectives": {"launcher", "checks"}}
EXEMPT = {"launcher/cli.py"}


def import_edges() -> list[tuple[str, int, str]]:
    """(file, line, imported package) for every import of one of our packages."""
    edges = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue  # relative imports stay inside their package
                for name in names:
                    top = name.split(".")[0]
                    if top in PACKAGES and top != pkg:
                        edges.append((rel, node.lineno, top))
    return edges


def test_the_edge_reader_sees_the_allowed_direction():
    # checks/ does use launcher/: if the reader found nothing, the test below would prove nothing.
    assert any(f.startswith("checks/") and to == "launcher" for f, _, to in import_edges())
    assert any(f == "launcher/cli.py" and to == "checks" for f, _, to in import_edges())


def test_dependencies_run_one_way():
    bad = [f"{f}:{line} imports {to}" for f, line, to in import_edges()
           if f not in EXEMPT and to in FORBIDDEN[f.split("/")[0]]]
    assert not bad, "imports against the direction (see docs/architecture.md):\n" + "\n".join(bad)
