"""The shape of the code, enforced: a test that reads every import and function with ``ast``.

* ``launcher/`` never imports ``checks/`` (``launcher/cli.py``, the top of the program,
  may import everything);
* ``collectives/`` (the runtime on every rank) imports neither ``launcher/`` nor ``checks/``;
* ``launcher/remote/`` (what runs on other hosts) imports only the standard library, itself and
  the formats it shares with the runtime (``dtrun/recorderfile.py``, ``dtrun/commitstore.py``,
  standard library only);
* no import cycle between modules of ``launcher/``, ``checks/`` and ``collectives/``;
* no function over 60 lines there unless a ``# long: <reason>`` comment says why.

Imports inside functions count too: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("launcher", "checks", "collectives")
FORBIDDEN = {"launcher": {"checks"}, "checks": set(), "collectives": {"launcher", "checks"}}
EXEMPT = {"launcher/cli.py"}
REMOTE = "launcher.remote"
# Formats the runtime and the remote code share, at the top of the dtrun package (dtrun/).
SHARED = {"dtrun.recorderfile", "dtrun.commitstore"}
# Third-party modules the remote code may try inside ``try:``: the doctor's probe reports whether
# the job's Python can import them, and a failure there is its finding, not a crash.
PROBED = {"mpi4py"}
MAX_LINES = 60
LONG_REASON = re.compile(r"#\s*long:\s*\S")


def _sources(root: Path, packages=PACKAGES):
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            yield path, path.relative_to(root).as_posix()


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``tree``, relative ones resolved.

    ``from a import b`` yields ``a.b`` as well as ``a``: ``b`` may be a module. Names are
    given without the ``dtrun.`` namespace (``dtrun.launcher.x`` is ``launcher.x``, the folder).
    """
    base = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                name = ".".join(anchor + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "dtrun" and node.names:  # from dtrun import collectives
                out += [(node.lineno, a.name) for a in node.names]
                continue
            out.append((node.lineno, name))
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names if a.name != "*"]
    return [(line, name[len("dtrun."):] if name.startswith("dtrun.") else name) for line, name in out]


def import_edges() -> list[tuple[str, int, str]]:
    """(file, line, imported package) for every import of one of our packages."""
    return [(rel, line, name.split(".")[0]) for rel, line, name in _full_edges(REPO)
            if name.split(".")[0] != rel.split("/")[0]]


def _full_edges(root: Path, packages=PACKAGES) -> list[tuple[str, int, str]]:
    """(file, line, dotted name) for every import of a name in one of ``packages``."""
    edges = []
    for path, rel in _sources(root, packages):
        tree = ast.parse(path.read_text(), rel)
        for line, name in imported_names(tree, _module_name(rel), path.name == "__init__.py"):
            if name.split(".")[0] in packages:
                edges.append((rel, line, name))
    return edges


def module_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules it imports (each name resolved to the module that defines it)."""
    modules = {_module_name(rel) for _, rel in _sources(root, packages)}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for rel, _, name in _full_edges(root, packages):
        here = _module_name(rel)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        # A package's own __init__ importing its submodules is how packages are built, not a cycle.
        if name and name != here and not here.startswith(name + "."):
            graph[here].add(name)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(cycles)


def non_stdlib_imports(root: Path, package: str) -> list[str]:
    """``file:line imports name`` for each import in ``package`` of neither the stdlib nor itself."""
    bad = []
    pkg_dir = root / package.replace(".", "/")
    for path in sorted(pkg_dir.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), rel)
        tried = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for s in t.body for n in ast.walk(s)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    depth = len(path.relative_to(pkg_dir).parts) - 1  # folders below the package
                    if node.level > depth + 1:
                        bad.append(f"{rel}:{node.lineno} imports from outside {package} (relative)")
                    continue
                names = [node.module or ""]
                if node.module == "dtrun":  # from dtrun import recorderfile
                    names = [f"dtrun.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                own = name == package or name.startswith(package + ".") or name in SHARED
                probed = id(node) in tried and name.split(".")[0] in PROBED
                if not own and not probed and name.split(".")[0] not in sys.stdlib_module_names:
                    bad.append(f"{rel}:{node.lineno} imports {name}")
    return bad


def long_functions(root: Path, packages=PACKAGES, limit: int = MAX_LINES) -> list[str]:
    """``file:line name (N lines)`` for each function over ``limit`` lines without a reason.

    The reason is a ``# long: <reason>`` comment on the line before the ``def`` (or before
    its decorators), on the signature, or on the first line of its body.
    """
    rows = []
    for path, rel in _sources(root, packages):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, rel)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            n = node.end_lineno - node.lineno + 1
            if n <= limit:
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            candidates = [first - 1, node.lineno - 1] + list(range(node.lineno, node.body[0].lineno + 1))
            if any(0 < i <= len(lines) and LONG_REASON.search(lines[i - 1]) for i in candidates):
                continue
            rows.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    return rows


def test_the_edge_reader_sees_the_allowed_direction():
    # checks/ does use launcher/: if the reader found nothing, the test below would prove nothing.
    assert any(f.startswith("checks/") and to == "launcher" for f, _, to in import_edges())
    assert any(f == "launcher/cli.py" and to == "checks" for f, _, to in import_edges())


def test_dependencies_run_one_way():
    bad = [f"{f}:{line} imports {name}" for f, line, name in _full_edges(REPO)
           if f not in EXEMPT and name.split(".")[0] in FORBIDDEN[f.split("/")[0]]]
    assert not bad, "imports against the direction (see docs/architecture.md):\n" + "\n".join(bad)


def test_the_runtime_never_imports_the_launcher():
    # Every training process imports collectives/: it must not pull in the launcher package.
    assert FORBIDDEN["collectives"] >= {"launcher", "checks"}
    edges = [(f, name) for f, _, name in _full_edges(REPO) if f.startswith("collectives/")]
    assert edges, "the runtime's imports were not read"
    assert not [e for e in edges if e[1].split(".")[0] in ("launcher", "checks")], edges


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_cycle_finder_sees_a_cycle_through_a_lazy_relative_import(tmp_path):
    # So that the no-cycle test below cannot pass because the finder finds nothing.
    _write(tmp_path, {
        "pkg/__init__.py": "from . import a\n",
        "pkg/a.py": "from pkg.b import helper\n",
        "pkg/b.py": "def helper():\n    from .c import other\n    return other\n",
        "pkg/c.py": "import pkg.a\nother = 1\n",
        "pkg/d.py": "from pkg import a\n",
    })
    graph = module_graph(tmp_path, ("pkg",))
    assert graph["pkg.d"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_import_cycles():
    graph = module_graph(REPO)
    assert sum(len(v) for v in graph.values()) > 50  # the graph was read
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_stdlib_check_sees_a_third_party_import(tmp_path):
    _write(tmp_path, {
        "launcher/remote/__init__.py": "",
        "launcher/remote/ok.py": ("import os, json\nfrom . import wire\nfrom launcher.remote.wire import X\n"
                                  "from dtrun import recorderfile\n"),
        "launcher/remote/wire.py": "X = 1\n",
        "launcher/remote/bad.py": "def f():\n    import numpy\n    from launcher.errors import E\n    import mpi4py\n",
        "launcher/remote/probe.py": "try:\n    import mpi4py\nexcept ImportError:\n    pass\n",
        "launcher/remote/up.py": "from .. import cli\n",
        "launcher/remote/outside.py": "from dtrun import launcher\n",
    })
    assert non_stdlib_imports(tmp_path, REMOTE) == [
        "launcher/remote/bad.py:2 imports numpy", "launcher/remote/bad.py:3 imports launcher.errors",
        "launcher/remote/bad.py:4 imports mpi4py", "launcher/remote/outside.py:1 imports dtrun.launcher",
        "launcher/remote/up.py:1 imports from outside launcher.remote (relative)"]


def test_remote_code_imports_only_the_standard_library():
    # What runs on another host must work where its Python environment is broken.
    pkg = REPO / "launcher" / "remote"
    assert (pkg / "__init__.py").is_file(), "launcher/remote/ (the code that runs on other hosts) is missing"
    assert len(list(pkg.glob("*.py"))) > 1
    bad = non_stdlib_imports(REPO, REMOTE)
    assert not bad, "launcher/remote/ must use the standard library only:\n" + "\n".join(bad)
    for name in SHARED:  # and what it shares with the runtime, too
        shared = REPO / (name.replace(".", "/") + ".py")
        tree = ast.parse(shared.read_text())
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert all(isinstance(n, ast.Import) and all(a.name.split(".")[0] in sys.stdlib_module_names
                                                     for a in n.names) for n in imports), name


def test_the_length_check_sees_a_long_function_and_its_reason(tmp_path):
    body = "    x = 1\n" * 60
    _write(tmp_path, {"pkg/m.py": (
        f"def long_one():\n{body}\n"
        f"# long: one table, read top to bottom\ndef explained():\n{body}\n"
        f"def explained_inside():\n    # long: one table\n{body}\n"
        f"def short():\n{'    x = 1' + chr(10)}\n")})
    assert long_functions(tmp_path, ("pkg",)) == ["pkg/m.py:1 long_one (61 lines)"]


def test_no_function_over_60_lines_without_a_reason():
    rows = long_functions(REPO)
    assert not rows, (f"functions over {MAX_LINES} lines (split them, or say why on the line before "
                      "the def: # long: <reason>):\n" + "\n".join(rows))


MAX_MODULE_LINES = 600
LAZY_REASON = re.compile(r"#\s*lazy:\s*\S")
# Function-level imports of our own modules that may exist, each with its ``# lazy:`` reason.
# The number only goes down; raise it only together with a reason on the new import.
MAX_LAZY_IMPORTS = 43


def long_modules(root: Path, packages=PACKAGES, limit: int = MAX_MODULE_LINES) -> list[str]:
    """``file (N lines)`` for each module over ``limit`` lines."""
    return [f"{rel} ({n} lines)" for path, rel in _sources(root, packages)
            if (n := len(path.read_text().splitlines())) > limit]


def lazy_imports(root: Path, packages=PACKAGES) -> tuple[list[str], list[str]]:
    """(every function-level import of one of ``packages``, those without a ``# lazy:`` reason),
    each as ``file:line name``. The reason is a comment on one of the statement's lines or on
    the line before it."""
    found, unexplained = [], []
    for path, rel in _sources(root, packages):
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, rel)
        module = _module_name(rel)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                names = [n for _, n in imported_names(node, module, path.name == "__init__.py")]
                ours = [n for n in names if n.split(".")[0] in packages]
                if not ours:
                    continue
                row = f"{rel}:{node.lineno} {ours[0]}"
                found.append(row)
                span = range(node.lineno - 1, node.end_lineno + 1)
                if not any(0 < i <= len(lines) and LAZY_REASON.search(lines[i - 1]) for i in span):
                    unexplained.append(row)
    return sorted(set(found)), sorted(set(unexplained))


def test_the_module_and_lazy_import_checks_see_what_they_look_for(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/big.py": "x = 1\n" * 601,
        "pkg/small.py": "x = 1\n" * 600,
        "pkg/m.py": ("import os\n\n\ndef f():\n    from . import small\n    import json\n"
                     "    from pkg import big  # lazy: only f needs it\n"
                     "    # lazy: start-up time\n    from pkg.small import x\n    return x\n"),
    })
    assert long_modules(tmp_path, ("pkg",)) == ["pkg/big.py (601 lines)"]
    found, unexplained = lazy_imports(tmp_path, ("pkg",))
    assert found == ["pkg/m.py:5 pkg", "pkg/m.py:7 pkg", "pkg/m.py:9 pkg.small"]
    assert unexplained == ["pkg/m.py:5 pkg"]


def test_no_module_over_600_lines():
    rows = long_modules(REPO)
    assert not rows, f"modules over {MAX_MODULE_LINES} lines (split them by concern):\n" + "\n".join(rows)


def test_every_lazy_import_says_why_and_they_do_not_grow():
    found, unexplained = lazy_imports(REPO)
    assert found, "the reader found no function-level import: it would prove nothing"
    assert not unexplained, ("imports of our own modules inside functions without a reason (move them to the "
                             "module's top, or say why on the line: # lazy: <reason>):\n" + "\n".join(unexplained))
    assert len(found) <= MAX_LAZY_IMPORTS, (
        f"{len(found)} function-level imports of our own modules, more than {MAX_LAZY_IMPORTS}:\n" + "\n".join(found))
