"""Every stop signal at every moment from dtrun's start to its exit stops everything it started.

The moments that matter are the ones a person cannot hit by hand: a few milliseconds
after dtrun starts (while it imports and parses), and 0-5 ms after mpirun exists (before
dtrun's supervisor followed it), in the first attempt and in a restart. Each run is the
installed ``dtrun`` with a real mpirun and real ranks; the test watches dtrun's children in
/proc and sends the signal from outside, as `kill` or a scheduler would.
"""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.dtrun_helpers import DTRUN, PYTHON, REPO, finish, processes_with, user_env, wait_until_empty

pytestmark = pytest.mark.mpi

SLEEPER = ("import os, sys, time\nfrom mpi4py import MPI\n"
           "if os.environ.get('FAIL_FIRST') and os.environ.get('DTRUN_RESTART_COUNT') == '0':\n"
           "    sys.exit(3)\n"
           "MPI.COMM_WORLD.Barrier()\nprint('up', flush=True)\ntime.sleep(120)\n")


def _children_with(pid: int, token: str) -> set:
    """The mpirun children of ``pid`` that carry ``token`` on their command line (the program's path)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return set()
    found = set()
    for child in children:
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # dtrun's forked children carry dtrun's own command line until they exec
        if os.path.basename(argv[0]).startswith((b"mpirun", b"prterun", b"mpiexec")) and \
                any(token.encode() in a for a in argv):
            found.add(child)
    return found


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _mpirun_starts(proc, token: str, nth: int, timeout: float = 60.0) -> bool:
    """Wait until dtrun has started its ``nth`` mpirun (1-based); False if dtrun ended first."""
    seen: set = set()  # mpirun's pid stays when it execs prterun (Open MPI 5): count pids
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        seen |= _children_with(proc.pid, token)
        if len(seen) >= nth:
            return True
    return False


def _job_records(pid: int) -> list:
    from dtrun.launcher.jobstate import jobs_dir

    d = jobs_dir()
    return [p.name for p in d.iterdir() if f"-{pid}" in p.name] if d.is_dir() else []


def _as_a_terminals_job() -> None:
    """SIGINT and SIGQUIT as a terminal's job has them. A suite run in the background of a shell
    without job control (``make test &`` in a script) inherits both ignored, and a signal that
    came before dtrun had its handlers in would then be ignored, as the caller asked."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _run_and_signal(tmp_path, sig, moment, delay_ms, extra=("-np", "2"), env_extra=None, leftovers=None):
    """Start dtrun on the sleeper job, send ``sig`` at ``moment`` + ``delay_ms``; returns dtrun's
    exit code and stderr, what is left of the job (``leftovers(token)``, by default every process
    whose command line holds the token) and the job records left behind."""
    token = f"dtsig{os.getpid()}x{time.monotonic_ns()}"
    script = tmp_path / f"{token}.py"
    script.write_text(SLEEPER)
    env = user_env(**(env_extra or {}))
    proc = subprocess.Popen([DTRUN, *extra, "python", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                            preexec_fn=_as_a_terminals_job)
    try:
        if moment == "dtrun":
            _spin(delay_ms / 1000)
        else:
            nth = 2 if moment == "restart" else 1
            assert _mpirun_starts(proc, token, nth), f"dtrun ended before mpirun #{nth}: {proc.communicate()}"
            _spin(delay_ms / 1000)
        proc.send_signal(sig)
        rc, out, err = finish(proc, 40)
    finally:
        if proc.poll() is None:
            proc.kill()
    find = leftovers or processes_with
    left = wait_until_empty(lambda: find(token), timeout=15)
    records = _job_records(proc.pid)
    return rc, err, left, records


MOMENTS = [("dtrun", 0), ("dtrun", 40), ("dtrun", 150), ("mpirun", 0), ("mpirun", 1), ("mpirun", 2),
           ("mpirun", 5)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("moment, delay_ms", MOMENTS, ids=[f"{m}+{d}ms" for m, d in MOMENTS])
def test_a_signal_at_any_moment_stops_everything_with_the_documented_code(tmp_path, sig, moment, delay_ms):
    rc, err, left, records = _run_and_signal(tmp_path, sig, moment, delay_ms)
    name = signal.Signals(sig).name
    # Before dtrun's first line runs (the interpreter still starting: site, .pth files), the
    # signal's own action ends it, and for SIGINT Python prints its KeyboardInterrupt: a shell
    # reports that as 128 + n too, and nothing has been started yet (checked below). SIGINT
    # while the site module imports (a slow start on a busy machine) is Python's fatal error, exit 1.
    died_early = moment == "dtrun" and (rc == -int(sig) or (
        sig == signal.SIGINT and rc == 1 and "Fatal Python error: init_import_site" in err))
    assert rc == 128 + int(sig) or died_early, f"exit {rc}, expected {128 + int(sig)}: {err}"
    if not died_early:  # dtrun's handler took it, at whatever moment: it says so
        assert "Traceback" not in err, err
        assert f"stopped by {name}" in err, err
    assert left == [], f"left running after dtrun exited: {[p.info['cmdline'] for p in left]}\n{err}"
    assert records == [], f"stale job records: {records}"


RESTART_MOMENTS = [("mpirun", 0), ("mpirun", 2), ("restart", 0), ("restart", 1), ("restart", 3)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("moment, delay_ms", RESTART_MOMENTS, ids=[f"{m}+{d}ms" for m, d in RESTART_MOMENTS])
def test_a_signal_at_any_moment_of_a_restarted_run_ends_the_run(tmp_path, sig, moment, delay_ms):
    """With --max-restarts: a signal as an attempt's mpirun starts stops it and no attempt follows
    ('restart': the second attempt, after the first failed by itself)."""
    rc, err, left, records = _run_and_signal(tmp_path, sig, moment, delay_ms, ("-np", "2", "--max-restarts", "3"),
                                             {"FAIL_FIRST": "1"} if moment == "restart" else None)
    name = signal.Signals(sig).name
    assert rc == 128 + int(sig), f"exit {rc}, expected {128 + int(sig)}: {err}"
    assert f"stopped by {name}" in err and "Traceback" not in err, err
    assert "attempt 3 of 4" not in err, err
    assert left == [], f"left running after dtrun exited: {[p.info['cmdline'] for p in left]}\n{err}"
    assert records == [], f"stale job records: {records}"


HOSTS_MOMENTS = [(signal.SIGTERM, 0), (signal.SIGINT, 1), (signal.SIGTERM, 3), (signal.SIGINT, 30),
                 (signal.SIGTERM, 150)]


@pytest.mark.cluster
@pytest.mark.parametrize("sig, delay_ms", HOSTS_MOMENTS,
                         ids=[f"{signal.Signals(s).name}-mpirun+{d}ms" for s, d in HOSTS_MOMENTS])
def test_a_signal_as_mpirun_starts_leaves_nothing_on_any_host(cluster3, tmp_path, sig, delay_ms):
    """Across 3 namespace hosts, while mpirun is still starting its daemons over ssh."""
    from tests.test_multihost import _job_procs, described, host_list

    assert _job_procs("dtsig", cluster3) == [], "an earlier job on this cluster left processes"
    argv = ("--ssh-config", str(cluster3.ssh_config), "-H", host_list(cluster3, [1, 1, 1]))
    rc, err, left, records = _run_and_signal(tmp_path, sig, "mpirun", delay_ms, argv,
                                             leftovers=lambda token: _job_procs(token, cluster3))
    assert rc == 128 + int(sig), f"exit {rc}: {err}"
    assert f"stopped by {signal.Signals(sig).name}" in err and "Traceback" not in err, err
    assert left == [], described(left)
    assert records == []


LOST_STOP = r"""
import os, signal, sys, time, weakref
from dtrun.launcher.job import stopsignals
stopsignals.install()
sig = int(sys.argv[1])

class A:
    pass

def callback(_):  # code whose exceptions Python ignores, like the import system's module-lock callbacks
    os.kill(os.getpid(), sig)
    for _ in range(10000):
        pass  # the handler runs in here: its Stopped is "ignored"

try:
    a = A()
    ref = weakref.ref(a, callback)
    del a
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # ordinary code: where the stop must land
        time.sleep(0.01)
    print("went on")
except stopsignals.Stopped as exc:
    print("stopped", exc.signum)
    sys.exit(stopsignals.exit_code(exc.signum))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT], ids=["SIGTERM", "SIGINT", "SIGQUIT"])
def test_a_stop_signal_inside_code_whose_exceptions_python_ignores_still_stops(tmp_path, sig):
    """CI met it: SIGINT 40 ms after dtrun started arrived while the import system ran a
    weakref callback; Python printed "Exception ignored" and dtrun launched the job anyway."""
    script = tmp_path / "lost.py"
    script.write_text(LOST_STOP)
    p = subprocess.run([PYTHON, str(script), str(int(sig))], capture_output=True,
                       text=True, timeout=60, env=user_env())
    assert (p.returncode, p.stdout) == (128 + sig, f"stopped {int(sig)}\n"), p.stderr
    assert "Exception ignored" not in p.stderr
