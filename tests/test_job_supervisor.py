"""The job supervisor (launcher/job/): every cause stops a job through ``JobSupervisor.stop``,
and the result says which one, as a ``StopReason``.

Each job is a real ``dtrun`` launch (its CLI entry point, in this process, so that the
``JobResult`` it produced can be read back), with real mpirun and real ranks; the exit code
and the line users see are those dtrun has always given for that cause.
"""
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from dtrun.launcher.cli import main
from dtrun.launcher.job import supervisor
from dtrun.launcher.job.result import StopReason
from tests.dtrun_helpers import PYTHON

pytestmark = pytest.mark.mpi

HOST = os.uname().nodename
# Each rank says it is up (a file named after its pid in UP_DIR), then sleeps.
SLEEPER = "import os, time; open(os.path.join(os.environ['UP_DIR'], str(os.getpid())), 'w').close(); time.sleep(120)"


@pytest.fixture
def launched(monkeypatch):
    """The JobResults of the launches in this test (run_job itself runs unchanged)."""
    results = []
    real = supervisor.run_job

    def recording(*args, **kw):
        results.append(real(*args, **kw))
        return results[-1]

    monkeypatch.setattr(supervisor, "run_job", recording)
    return results


def _dtrun(*args):
    """dtrun's exit code for ``args``, run through its entry point in this process."""
    with pytest.raises(SystemExit) as ended:
        main(list(args))
    return ended.value.code


def _when_up(up_dir, n, then):
    """On a thread: once ``n`` ranks are up, call ``then``."""
    def wait():
        deadline = time.monotonic() + 60
        while len(os.listdir(up_dir)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        then()

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def test_sigint_stops_the_job_as_a_signal(launched, capfd, tmp_path, monkeypatch):
    monkeypatch.setenv("UP_DIR", str(tmp_path))
    waiter = _when_up(tmp_path, 2, lambda: os.kill(os.getpid(), signal.SIGINT))
    rc = _dtrun("-np", "2", PYTHON, "-c", SLEEPER)
    waiter.join(5)
    err = capfd.readouterr().err
    assert rc == 130, err
    assert "dtrun: stopped by SIGINT; mpirun stopped the job on every host" in err
    (result,) = launched
    assert result.stop_reason is StopReason.SIGNAL and result.stop.signum == signal.SIGINT
    assert result.interrupted and result.returncode == 130


def test_timeout_stops_the_job_as_a_timeout(launched, capfd, tmp_path, monkeypatch):
    monkeypatch.setenv("UP_DIR", str(tmp_path))
    rc = _dtrun("--timeout", "3", "-np", "2", PYTHON, "-c", SLEEPER)
    err = capfd.readouterr().err
    assert rc == 124, err
    assert "dtrun: the job ran longer than --timeout 3 s; the job was stopped (exit 124)" in err
    (result,) = launched
    assert result.stop_reason is StopReason.TIMEOUT
    assert result.stop.detail == "the job ran longer than --timeout 3 s" == result.timeout


def test_a_failed_rank_whose_peers_run_on_is_stopped_as_rank_failed(launched, capfd, tmp_path, monkeypatch):
    """As under MPICH's Hydra: the launcher lets the other ranks run after one failed, so dtrun
    stops the job itself (the system's Open MPI 4 is told to behave so)."""
    system_mpirun = shutil.which("mpirun", path="/usr/bin")
    if system_mpirun is None:
        pytest.skip("no system Open MPI (openmpi-bin) in /usr/bin")
    monkeypatch.setenv("UP_DIR", str(tmp_path))
    monkeypatch.setenv("OMPI_MCA_orte_abort_on_non_zero_status", "0")
    program = ("import os, sys, time; r = int(os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('PMI_RANK', 0)))\n"
               "if r == 1: sys.exit(3)\n" + SLEEPER)
    rc = _dtrun("--mpirun", system_mpirun, "-np", "2", PYTHON, "-c", program)
    err = capfd.readouterr().err
    assert rc == 3, err
    assert f"dtrun: job failed: rank 1 on {HOST} exited with code 3" in err
    (result,) = launched
    assert result.stop_reason is StopReason.RANK_FAILED
    assert result.stop.detail == f"rank 1 on {HOST} exited with code 3"


def test_hang_abort_stops_the_job_as_a_hang(launched, capfd, tmp_path, monkeypatch):
    monkeypatch.setenv("UP_DIR", str(tmp_path))
    rc = _dtrun("--hang-timeout", "3", "--on-hang", "abort", "-np", "2", PYTHON, "-c", SLEEPER)
    err = capfd.readouterr().err
    assert rc == 125, err
    assert "dtrun: the job made no progress and was stopped (--on-hang abort; exit code 125)" in err
    (result,) = launched
    assert result.stop_reason is StopReason.HANG and result.hung
    assert result.stop.detail == "no progress (--on-hang abort)"


def test_a_job_that_ends_by_itself_has_no_stop_reason(launched, capfd):
    assert _dtrun("-np", "2", PYTHON, "-c", "print('hi')") == 0
    (result,) = launched
    assert result.stop is None and result.stop_reason is None and not result.stopped


def test_a_second_stop_keeps_the_first_reason_and_escalates():
    proc = subprocess.Popen(["true"])
    proc.wait()
    job = supervisor.JobSupervisor(proc)
    assert job.stop_state is None
    job.stop(StopReason.TIMEOUT, "the job ran longer than --timeout 5 s")
    job.stop(StopReason.SIGNAL, "stopped by SIGTERM", signum=signal.SIGTERM)
    job.stop(StopReason.RANK_FAILED, "rank 0 on h1 exited with code 1")
    assert job.stop_reason is StopReason.TIMEOUT
    assert job.stop_state.detail == "the job ran longer than --timeout 5 s"
    assert job.stop_requests == 3  # SIGINT, then SIGTERM, then the session is killed
    assert job.signum == signal.SIGTERM  # the signal is still what dtrun's exit code follows
    with pytest.raises(TypeError):
        job.stop("no progress (--on-hang abort)")
