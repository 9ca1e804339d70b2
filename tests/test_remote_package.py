"""launcher/remote/: what runs on other hosts uses the standard library only, starts as a
script without site-packages, shares its marker format with the launcher, and reads the flight
recorder and the elastic commits in the formats the runtime writes (dtrun/recorderfile.py,
dtrun/commitstore.py, which neither side owns)."""
import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtrun import recorderfile
from dtrun.launcher.remote import wire

REPO = Path(__file__).resolve().parent.parent
REMOTE = REPO / "launcher" / "remote"
MODULES = sorted(p.stem for p in REMOTE.glob("*.py") if p.stem != "__init__")
# What a module looks for, inside a try, as the thing it reports on: the probe tells whether
# the job's Python can load mpi4py.
REPORTED = {("probe", "mpi4py")}
# Formats shared with the runtime: standard library only, at the top of the dtrun package.
SHARED = {"dtrun.recorderfile", "dtrun.commitstore"}


def imported(path):
    """Every module name an ``import`` or ``from`` in ``path`` names (function-level included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            # siblings by relative import (one level: this package), so the same file works as
            # dtrun.launcher.remote.X and as a script (its __package__ set, PEP 366)
            assert node.level in (0, 1), f"{path.name}: import beyond launcher/remote"
            if node.level:
                names.append("launcher.remote" + (f".{node.module}" if node.module else ""))
            elif node.module == "dtrun":  # from dtrun import recorderfile
                names += [f"dtrun.{a.name}" for a in node.names]
            else:
                names.append(node.module)
    return names


def test_the_package_holds_every_module_that_runs_on_another_host():
    assert {"agent", "probe", "procfs", "rankexec", "rankstate", "sessiondirs", "wire"} <= set(MODULES)
    for old in ("launcher/rankexec.py", "launcher/stackagent.py", "launcher/sessiondirs.py",
                "launcher/rankstate.py", "checks/remote_probe.py"):
        assert not (REPO / old).exists(), old


@pytest.mark.parametrize("name", ["__init__"] + MODULES)
def test_imports_only_the_standard_library_and_itself(name):
    bad = [m for m in imported(REMOTE / f"{name}.py")
           if m.split(".")[0] not in sys.stdlib_module_names and m != "launcher.remote"
           and not m.startswith("launcher.remote.") and m not in SHARED and (name, m) not in REPORTED]
    assert bad == []


@pytest.mark.parametrize("name", sorted(SHARED))
def test_the_shared_formats_import_only_the_standard_library(name):
    names = imported(REPO / (name.replace(".", "/") + ".py"))
    assert [m for m in names if m.split(".")[0] not in sys.stdlib_module_names] == []


def test_launcher_package_imports_nothing():
    """The scripts' bootstrap imports launcher/__init__.py first: it must pull in nothing."""
    assert imported(REPO / "launcher" / "__init__.py") == []


def run_script(tmp_path, name, *args, stdin=None):
    """``python3 -S launcher/remote/NAME.py ARGS`` from a directory outside the repository,
    with an environment that points nowhere near it."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-S", str(REMOTE / f"{name}.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, input=stdin)


def test_agent_starts_as_a_script(tmp_path):
    p = run_script(tmp_path, "agent")
    assert (p.returncode, p.stderr) == (2, "usage: agent.py dump|watch|kill|reap|tidy|sample|notice|forget JOB_DIR [SECONDS]\n")
    p = run_script(tmp_path, "agent", "tidy", str(tmp_path / "none"))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["tidied"] == []


def test_rankexec_starts_as_a_script(tmp_path):
    p = run_script(tmp_path, "rankexec")
    assert p.returncode == 2 and "rankexec: no program given" in p.stderr, p.stderr
    p = run_script(tmp_path, "rankexec", "--", "/bin/sh", "-c", "exit 3")
    assert p.returncode == 3
    assert p.stdout.splitlines()[-1] == "dtrun-rank-eof: rank=0"


def test_probe_starts_as_a_script(tmp_path):
    p = run_script(tmp_path, "probe", stdin='{"gpu": false, "mpi_load": false}\n')
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout.splitlines()[0])
    assert "error" not in rep, rep
    assert set(rep["stale_sessions"]) == {"count", "paths"} and rep["hostname"]


def test_sessiondirs_and_library_modules_load_without_site_packages(tmp_path):
    code = ("import sys; sys.path[0] = sys.argv[1]; import importlib; "
            "[importlib.import_module('launcher.remote.' + m) for m in sys.argv[2:]]; "
            "print(sorted(k for k in sys.modules if k.startswith('launcher')))")
    p = subprocess.run([sys.executable, "-S", "-c", code, str(REPO), *MODULES], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    assert eval(p.stdout) == sorted(["launcher", "launcher.remote"] + [f"launcher.remote.{m}" for m in MODULES])


def test_scripts_start_from_an_installed_copy(tmp_path):
    """Installed, launcher/ sits inside the dtrun package (site-packages/dtrun/launcher) and
    ``python -S`` leaves site-packages off the path: the agent and the rank wrapper still find
    the recorder's format (dtrun/recorderfile.py) beside them, and nothing else of dtrun's."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "dtrun", site / "dtrun", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "launcher", site / "dtrun" / "launcher", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "dtrun" / "__init__.py").write_text("raise ImportError('not run by the remote scripts')\n")
    remote = site / "dtrun" / "launcher" / "remote"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    job = tmp_path / "job"
    job.mkdir()
    p = subprocess.run([sys.executable, "-S", str(remote / "agent.py"), "dump", str(job)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout)["ranks"] == [], p.stderr
    p = subprocess.run([sys.executable, "-S", str(remote / "rankexec.py"), "--", "/bin/sh", "-c", "exit 3"],
                       cwd=tmp_path, env={**env, "DTRUN_JOB_DIR": str(job)}, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 3 and p.stdout.splitlines()[-1] == "dtrun-rank-eof: rank=0", p.stderr


def test_probe_bundle_runs_where_no_copy_of_the_package_exists(tmp_path):
    """What doctor sends to a host: one program, run by ``python3 -c`` from stdin."""
    from dtrun.checks.probesession import boot_command, probe_input

    p = subprocess.run(["sh", "-c", boot_command("/nonexistent/python")], input=probe_input({"gpu": False}),
                       capture_output=True, cwd=tmp_path, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout.splitlines()[0])
    assert "error" not in rep, rep
    assert set(rep["stale_sessions"]) == {"count", "paths"}


def test_markers_round_trip():
    """What the wrapper writes is what the launcher's reader takes apart."""
    from dtrun.launcher.job.markers import parse_marker, parse_start_marker

    tok = "abc123"
    line = wire.exit_line(tok, "3", "h1", 17.5, signum=9, forwarded=False)
    f = parse_marker(line.rstrip("\n"), tok)
    assert (f.rank, f.host, f.signum, f.forwarded, f.time) == ("3", "h1", 9, False, 17.5)
    line = wire.exit_line(tok, "0", "h2", 1.0, code=127, start_error="command not found", program="nope\nx")
    f = parse_marker(line.rstrip("\n"), tok)
    assert (f.rank, f.host, f.code, f.start_error, f.program) == ("0", "h2", 127, "command not found", "nope x")
    assert parse_marker(wire.exit_line("other", "0", "h", 1.0, code=1), tok) is None  # another job's token
    assert parse_start_marker(wire.start_line(tok, "5", "h3"), tok) == ("5", "h3")
    assert wire.eof_line(tok, "7") == wire.eof_head(tok) + "7\n"


def test_recorder_written_by_the_runtime_is_read_by_the_agent(tmp_path):
    """The collectives' writer and the agent's reader share dtrun/recorderfile.py's format."""
    from dtrun.collectives import recorder
    from dtrun.launcher.remote import agent

    ring = recorder.open_ring(1, {"DTRUN_JOB_DIR": str(tmp_path)})
    assert ring is not None
    mm, slots = ring
    entries = [(1, "allreduce", "float32", 1000, None), (2, "broadcast", "int64", 7, 0),
               (3, "barrier", "", 0, None)]
    for seq, op, dtype, count, root in entries:
        slot = (seq % recorderfile.RING) * 2
        slots[slot + 1] = recorderfile.desc(op, dtype, count, root)
        slots[slot] = seq
    mm.flush()
    got = agent.read_recorder(str(tmp_path), 1)
    assert got["pid"] == os.getpid()
    assert [(e["seq"], e["op"], e["dtype"], e["count"], e["root"]) for e in got["entries"]] == entries
    assert agent.recorder_seq(str(tmp_path), 1) == 3
    assert recorder.decode(open(tmp_path / "rank.1.rec", "rb").read())["entries"] == got["entries"]
