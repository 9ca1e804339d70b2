"""Horovod's own test files, unchanged, as the judge of an engine: one test per 2-rank job.

Runs every test of Horovod's ``test/parallel`` files (or those ``-k`` selects) in a job of
its own, under

* ``dtrun``: ``dtrun --horovod -np 2 -H localhost:2 --oversubscribe PYTHON -m pytest ...``,
  where ``import horovod.torch`` loads ``dtrun.collectives.horovod.torch`` (the adapter);
* ``horovodrun``: ``horovodrun --gloo -np 2 -H localhost:2 PYTHON -m pytest ...`` from an
  environment where real Horovod is installed (the oracle),

and prints per file how many passed, failed, hung (no result within ``--timeout``) and
were skipped (by both ranks), then each test that did not pass with the first line of
what its ranks said. One job per test because a whole-file run desynchronises the ranks
after the first difference, and every later test would then inherit it.

Each rank runs pytest through this same file (``--rank-runner``, standard library and
pytest only, so it runs in either environment) and writes its outcome to a JSON file as
soon as each test phase reports: a rank that passed and then hung at exit is told apart
from one that never finished. A job past its timeout is killed whole: its process group,
every descendant, and every process that carries the job's tag in its environment (the
launchers start ranks in sessions of their own); the tool checks that none is left.

Horovod's tests are not part of this repository; take them from Horovod's checkout::

    git clone https://github.com/horovod/horovod && git -C horovod checkout v0.28.1
    python benchmarks/horovod_suite.py --tests horovod --files test_torch.py,test_tensorflow.py
    python benchmarks/horovod_suite.py --tests horovod --engine horovodrun \
        --python /path/to/horovod-env/bin/python --json oracle.json

``--tests`` is the checkout (or any folder holding ``test/parallel/*.py`` beside
``test/utils/common.py``), or the ``test/parallel`` folder itself. The ranks' Python needs
pytest, mock and cloudpickle (``common.py`` imports them), and the framework under test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

TAG_VAR = "HOROVOD_SUITE_JOB"
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMIX_RANK", "PMI_RANK")
OUTCOMES = ("passed", "failed", "hung", "skipped")


# ----------------------------------------------------------------------------- on a rank
class _Recorder:
    """pytest plugin: this rank's outcome of the one test it runs, written to ``path``
    after every phase (setup, call, teardown) so that a later hang loses nothing."""

    def __init__(self, path: Path):
        self.path = path
        self.state = {"outcome": None, "message": "", "finished": False}

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.state.update(outcome="failed", message="collection: " + _first_line(report))
            self._write()

    def pytest_runtest_logreport(self, report) -> None:
        s = self.state
        if report.failed and s["outcome"] != "failed":
            where = "" if report.when == "call" else f"{report.when}: "
            s.update(outcome="failed", message=where + _first_line(report))
        elif report.skipped and s["outcome"] is None:
            s.update(outcome="skipped", message=_first_line(report))
        elif report.when == "call" and report.passed and s["outcome"] is None:
            s["outcome"] = "passed"
        s["finished"] = report.when == "teardown"
        self._write()


def _first_line(report) -> str:
    """The first line of a failure (the exception and its message) or a skip's reason."""
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:  # a skip: (path, line, reason)
        return str(lr[2]).strip()
    crash = getattr(lr, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message.strip().splitlines()[0][:300]
    lines = [ln for ln in str(lr).splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("E ")]
    return (errs[0][1:].strip() if errs else lines[-1] if lines else "")[:300]


def rank_main(outdir: str, pytest_args: list[str]) -> int:
    """Run pytest on this rank, recording its outcome in OUTDIR/rank-N.json."""
    import pytest

    rank = next((os.environ[v] for v in RANK_VARS if v in os.environ), "0")
    rec = _Recorder(Path(outdir) / f"rank-{rank}.json")
    code = pytest.main(pytest_args, plugins=[rec])
    if rec.state["outcome"] is None:
        rec.state.update(outcome="failed", message=f"pytest ran no test (exit code {int(code)})")
    rec.state["finished"] = True
    rec._write()
    return int(code)


# ----------------------------------------------------------------------------- engines
@dataclass
class Engine:
    """How to start a job: the launcher's argv for N ranks, and the ranks' Python."""

    name: str
    launcher: list[str]
    python: str

    def argv(self, ranks: int) -> list[str]:
        hosts = ["-np", str(ranks), "-H", f"localhost:{ranks}"]
        if self.name == "dtrun":
            return [self.launcher[0], *self.launcher[1:], *hosts, "--oversubscribe", "-x", TAG_VAR]
        return [self.launcher[0], "--gloo", *hosts, *self.launcher[1:]]


def make_engine(args) -> Engine:
    """The engine from the options; exits with the fix when a piece is missing."""
    if args.engine == "horovodrun":
        hr = args.horovodrun or _near(args.python, "horovodrun") or shutil.which("horovodrun")
        if not hr:
            sys.exit("horovod_suite: no horovodrun: give --horovodrun PATH (real Horovod's)")
        py = args.python or str(Path(hr).parent / "python")
        return Engine("horovodrun", [hr], py)
    dt = args.dtrun or _near(sys.executable, "dtrun") or shutil.which("dtrun")
    if not dt:
        sys.exit("horovod_suite: no dtrun: give --dtrun PATH")
    help_text = subprocess.run([dt, "--help"], capture_output=True, text=True, timeout=60).stdout
    if "--horovod" in help_text:
        flags = ["--horovod"]
    elif args.alias:
        flags = ["-x", f"PYTHONPATH={Path(args.alias).resolve()}"]
    else:
        sys.exit("horovod_suite: this dtrun has no --horovod: give --alias DIR, a folder whose "
                 "'horovod' package loads dtrun.collectives.horovod")
    return Engine("dtrun", [dt, *flags], args.python or sys.executable)


def _near(python: str | None, tool: str) -> str | None:
    if not python:
        return None
    p = Path(python).parent / tool
    return str(p) if p.exists() else None


def parallel_dir(tests: str) -> Path:
    """The ``test/parallel`` folder of a Horovod checkout given as ``--tests``."""
    base = Path(tests).resolve()
    for d in (base / "test" / "parallel", base / "parallel", base):
        if d.is_dir() and (d.parent / "utils" / "common.py").is_file():
            return d
    sys.exit(f"horovod_suite: no test/parallel beside test/utils/common.py under {base}; "
             "see --help for how to get Horovod's tests")


# ----------------------------------------------------------------------------- jobs
@dataclass
class Result:
    test: str
    outcome: str
    message: str = ""
    seconds: float = 0.0
    ranks: dict = field(default_factory=dict)


def _env(tag: str) -> dict:
    env = dict(os.environ, **{TAG_VAR: tag})
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 ranks per job on a small machine
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def collect(engine: Engine, pdir: Path, name: str, kfilter: str | None, timeout: float) -> list[str]:
    """The test ids of one file, as pytest collects them in the engine's Python (1 rank)."""
    cmd = [*engine.argv(1), engine.python, "-m", "pytest", "--collect-only", "-q",
           "-p", "no:cacheprovider", "--rootdir", ".", name]
    if kfilter:
        cmd += ["-k", kfilter]
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, cwd=pdir, env=_env(tag), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc, tag)
        sys.exit(f"horovod_suite: collecting {name} took over {timeout:.0f} s: {' '.join(cmd)}")
    finally:
        kill_job(proc, tag)
    ids = sorted(set(re.findall(re.escape(name) + r"::\S+", out)))
    if not ids and "no tests" not in out and " deselected" not in out:
        sys.exit(f"horovod_suite: collecting {name} failed ({proc.returncode}): "
                 f"{' '.join(cmd)}\n{out[-3000:]}")
    return ids


def run_test(engine: Engine, pdir: Path, test: str, timeout: float, work: Path) -> Result:
    """One test in a 2-rank job of its own, classified from what its ranks recorded."""
    outdir = work / re.sub(r"[^\w.-]+", "_", test)
    outdir.mkdir(parents=True, exist_ok=True)
    log = outdir / "output.log"
    cmd = [*engine.argv(2), engine.python, str(Path(__file__).resolve()), "--rank-runner",
           str(outdir), "--", "-q", "-p", "no:cacheprovider", "--rootdir", ".", test]
    tag = uuid.uuid4().hex
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=pdir, env=_env(tag), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, stdin=subprocess.DEVNULL)
        try:
            proc.wait(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
        left = kill_job(proc, tag)
    ranks = {}
    for f in sorted(outdir.glob("rank-*.json")):
        ranks[int(f.stem.split("-")[1])] = json.loads(f.read_text())
    res = classify(test, ranks, None if hung else proc.returncode, timeout, log)
    res.seconds = round(time.monotonic() - t0, 1)
    if left and res.outcome != "hung":
        note = f"the job left {len(left)} process(es) running, killed: {'; '.join(left)}"
        res.message = f"{res.message} ({note})" if res.message else note
    return res


def classify(test: str, ranks: dict, code: int | None, timeout: float, log: Path) -> Result:
    """passed / failed / hung / skipped from the ranks' records and the job's exit code
    (None: killed at the timeout). Skipped: both ranks skipped."""
    states = {r: s.get("outcome") for r, s in ranks.items()}
    failed = {r: s["message"] for r, s in ranks.items() if s.get("outcome") == "failed"}
    if failed:
        if len(failed) > 1 and len(set(failed.values())) == 1:
            said = f"ranks {','.join(map(str, sorted(failed)))}: {failed[min(failed)]}"
        else:  # each rank's own first line: the root cause may be on any of them
            said = " | ".join(f"rank {r}: {failed[r][:200]}" for r in sorted(failed))
        extra = "" if code is not None else f"; then hung, killed after {timeout:.0f} s"
        return Result(test, "failed", said + extra, ranks=ranks)
    if code is None:
        if len(ranks) == 2 and all(s.get("finished") for s in ranks.values()):
            return Result(test, "hung", f"both ranks {'/'.join(sorted(set(map(str, states.values()))))}, "
                          f"then the job did not end within {timeout:.0f} s", ranks=ranks)
        said = ", ".join(f"rank {r} {states.get(r) or 'no result'}"
                         + ("" if ranks.get(r, {}).get("finished") else " (not finished)")
                         for r in (0, 1))
        return Result(test, "hung", f"no end after {timeout:.0f} s: {said}", ranks=ranks)
    missing = [r for r in (0, 1) if states.get(r) is None]
    if missing:
        return Result(test, "failed", f"rank {missing[0]} gave no result (job exit code {code}): "
                      f"{_last_error(log)}", ranks=ranks)
    if all(v == "skipped" for v in states.values()):
        return Result(test, "skipped", ranks[0]["message"], ranks=ranks)
    if code != 0:
        return Result(test, "failed", f"the ranks passed but the job exited with code {code}: "
                      f"{_last_error(log)}", ranks=ranks)
    return Result(test, "passed", ranks=ranks)


def _last_error(log: Path) -> str:
    """The job output's most telling line: the last Python exception, else the launcher's
    own verdict, else the last line that names an error or a signal, else the last line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern in (r"^(\[\d+\]<std\w+>:)?\s*[\w.]*(Error|Exception|Interrupt)\b",
                    r"^(dtrun|horovodrun|mpirun|prterun):",
                    r"[Ee]rror|Abort|[Ss]ignal|Killed"):
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:
            return hits[-1][:300]
    return (lines or ["(no output)"])[-1][:300]


def kill_job(proc: subprocess.Popen, tag: str, grace: float = 10.0) -> list[str]:
    """Kill the job's process group, its descendants and every process tagged with ``tag``
    (ranks in sessions of their own). A job that ended by itself first gets ``grace``
    seconds for its processes to finish exiting. Returns the "pid name" of each process
    that was still running (empty when none)."""
    ended = proc.poll() is not None
    deadline = time.monotonic() + (grace if ended else 0)
    while True:
        pids = (_descendants(proc.pid) | _tagged(tag)) - {os.getpid()}
        if not pids or time.monotonic() >= deadline:
            break
        time.sleep(0.2)  # an ended job's ranks may still be exiting: poll until gone
    if proc.poll() is None:
        pids.add(proc.pid)
    left = [f"{p} {_name(p)}" for p in sorted(pids)]
    if not pids:
        return left
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while (alive := {p for p in pids if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)  # reaped by their parents or by init: poll until gone
    if alive:
        print(f"horovod_suite: processes {sorted(alive)} of a job survive SIGKILL", file=sys.stderr)
    return left


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80].strip()
    except OSError:
        return "?"


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _descendants(pid: int) -> set[int]:
    kids, out, todo = _children_map(), set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _tagged(tag: str) -> set[int]:
    needle = f"{TAG_VAR}={tag}".encode()
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.add(int(d.name))
            except OSError:
                continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ----------------------------------------------------------------------------- report
def run_file(engine: Engine, pdir: Path, name: str, args, work: Path) -> list[Result]:
    """Every selected test of one file, ``args.jobs`` jobs at a time."""
    tests = collect(engine, pdir, name, args.k, max(args.timeout, 120))
    print(f"{name}: {len(tests)} tests", file=sys.stderr, flush=True)
    done = []

    def one(test: str) -> Result:
        r = run_test(engine, pdir, test, args.timeout, work)
        done.append(r)
        print(f"[{len(done)}/{len(tests)}] {r.outcome.upper():7} {test} ({r.seconds} s)"
              + (f": {r.message}" if r.outcome != "passed" else ""), file=sys.stderr, flush=True)
        return r
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        return list(pool.map(one, tests))


def report(results: dict[str, list[Result]], engine: Engine) -> str:
    """The per-file table and the tests that did not pass, as markdown."""
    lines = [f"engine: {' '.join(engine.argv(2))} {engine.python} -m pytest FILE::TEST", "",
             "| file | passed | failed | hung | skipped | total |", "|---|---:|---:|---:|---:|---:|"]
    for name, rs in results.items():
        n = {o: sum(r.outcome == o for r in rs) for o in OUTCOMES}
        lines.append(f"| `{name}` | " + " | ".join(str(n[o]) for o in OUTCOMES) + f" | {len(rs)} |")
    for name, rs in results.items():
        bad = [r for r in rs if r.outcome != "passed" or r.message]
        if bad:
            lines += ["", f"{name}, not passed (or passed with a note):"]
            order = {o: i for i, o in enumerate(("hung", "failed", "skipped", "passed"))}
            for r in sorted(bad, key=lambda r: (order[r.outcome], r.test)):
                lines.append(f"- {r.outcome.upper()} `{r.test.split('::')[-1]}`: {r.message}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-runner"]:
        return rank_main(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", required=True, help="Horovod checkout (or its test/parallel)")
    ap.add_argument("--files", default="test_torch.py", help="comma-separated files of "
                    "test/parallel (default test_torch.py)")
    ap.add_argument("--engine", choices=["dtrun", "horovodrun"], default="dtrun",
                    help="dtrun --horovod (the adapter, default) or horovodrun --gloo (real Horovod)")
    ap.add_argument("--python", help="the ranks' Python (dtrun: this one; horovodrun: the "
                    "python beside --horovodrun)")
    ap.add_argument("--horovodrun", help="real Horovod's horovodrun (default: beside --python, "
                    "then PATH)")
    ap.add_argument("--dtrun", help="dtrun (default: beside this Python, then PATH)")
    ap.add_argument("--alias", help="without dtrun --horovod: a folder whose 'horovod' package "
                    "loads dtrun.collectives.horovod, put first on the ranks' PYTHONPATH")
    ap.add_argument("--timeout", type=float, default=180, help="seconds per test; past it the "
                    "test counts as hung and its job is killed (default 180)")
    ap.add_argument("--jobs", type=int, default=1, help="tests run at once (2 ranks each)")
    ap.add_argument("-k", help="pytest -k expression selecting tests")
    ap.add_argument("--json", help="write every test's outcome and message here")
    ap.add_argument("--logs", help="keep each job's output under this folder")
    args = ap.parse_args(argv)
    engine, pdir = make_engine(args), parallel_dir(args.tests)
    work = Path(args.logs).resolve() if args.logs else Path(tempfile.mkdtemp(prefix="hvd-suite-"))
    try:
        results = {name: run_file(engine, pdir, name, args, work)
                   for name in args.files.split(",") if name}
    finally:
        if not args.logs:
            shutil.rmtree(work, ignore_errors=True)
    print(report(results, engine))
    if args.json:
        doc = {"engine": engine.name, "command": [*engine.argv(2), engine.python],
               "timeout_s": args.timeout,
               "files": {n: [asdict(r) for r in rs] for n, rs in results.items()}}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
