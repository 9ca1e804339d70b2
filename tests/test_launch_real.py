"""Real jobs through the installed dtrun: a real mpirun, real ranks, real signals."""
import os
import re
import subprocess
import time

import pytest

from tests.dtrun_helpers import DTRUN, PYTHON, dtrun, interrupt_when_up, wait_until_empty, processes_with

pytestmark = pytest.mark.mpi


def test_two_rank_hello_on_localhost():
    p = dtrun("--hostfile", "hostfiles/localhost", "python", "examples/hello.py")
    assert p.returncode == 0, p.stderr
    lines = sorted(l for l in p.stdout.splitlines() if l.startswith("rank "))
    host = os.uname().nodename
    assert lines == [f"rank 0/2 on {host} (local rank 0/2); sum of ranks = 1",
                     f"rank 1/2 on {host} (local rank 1/2); sum of ranks = 1"]


def test_every_rank_gets_dtrun_variables():
    prog = "import os; print('ENV', *(os.environ[k] for k in ('DTRUN_RANK','DTRUN_LOCAL_RANK','DTRUN_SIZE','DTRUN_LOCAL_SIZE')))"
    p = dtrun("-np", "3", "--oversubscribe", "-H", "localhost:2", "python", "-c", prog)
    assert p.returncode == 0, p.stderr
    assert sorted(l for l in p.stdout.splitlines() if l.startswith("ENV")) == \
        ["ENV 0 0 3 3", "ENV 1 1 3 3", "ENV 2 2 3 3"]


def test_failing_rank_gives_its_exit_code_and_names_it():
    prog = "from mpi4py import MPI\nc = MPI.COMM_WORLD\nif c.rank == 1: raise SystemExit(3)\nc.Barrier()"
    p = dtrun("-np", "2", "python", "-c", prog, timeout=60)
    assert p.returncode == 3, p.stderr
    assert f"dtrun: job failed: rank 1 on {os.uname().nodename} exited with code 3" in p.stderr


def test_uncaught_exception_aborts_the_job_instead_of_hanging():
    prog = ("from mpi4py import MPI\nc = MPI.COMM_WORLD\n"
            "if c.rank == 1: raise ValueError('boom on rank 1')\nc.allreduce(1)\nprint('unreachable')")
    t0 = time.monotonic()
    p = dtrun("-np", "2", "python", "-c", prog, timeout=60)
    assert time.monotonic() - t0 < 30
    assert p.returncode != 0
    assert "ValueError: boom on rank 1" in p.stderr
    assert "dtrun: job failed: rank 1" in p.stderr
    assert "unreachable" not in p.stdout


def test_rank_killed_by_signal_never_exits_zero():
    prog = "import os, signal, time\nif os.environ['DTRUN_RANK'] == '0': os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(0.5)"
    p = dtrun("-np", "2", "/bin/sh", "-c", f"exec {PYTHON} -c \"$0\"", prog, timeout=60)
    assert p.returncode != 0, p.stderr
    assert "killed by SIGKILL" in p.stderr


def test_log_dir_gives_each_run_its_own_files(tmp_path):
    """Like torchrun's per-attempt directories: DIR/<run>/rank.N.log, DIR/latest -> the newest run."""
    logs = tmp_path / "logs"
    runs = []
    for word in ("first", "second"):
        p = dtrun("-np", "2", "--log-dir", logs, "python", "-c",
                  f"import os; print('{word} from', os.environ['DTRUN_RANK'])")
        assert p.returncode == 0, p.stderr
        assert "from" not in p.stdout
        new = sorted(set(os.listdir(logs)) - {"latest"} - set(runs))
        assert len(new) == 1, new  # one new directory per run
        runs += new
    first, second = logs / runs[0], logs / runs[1]
    assert sorted(os.listdir(first)) == sorted(os.listdir(second)) == ["rank.0.log", "rank.1.log"]
    assert (first / "rank.1.log").read_text().strip() == "first from 1"
    assert (second / "rank.1.log").read_text().strip() == "second from 1"  # nothing of the first run
    assert os.readlink(logs / "latest") == second.name




def test_ctrl_c_stops_every_rank_and_exits_130(tmp_path):
    token = f"dtrun-sigint-{os.getpid()}-{time.monotonic_ns()}"
    prog = ("import sys, time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
            "print('up', flush=True)\ntime.sleep(120)\n")
    script = tmp_path / f"{token}.py"
    script.write_text(prog)
    def two_ranks_running():
        ranks = [p for p in processes_with(token) if "mpi4py" in p.cmdline()]
        assert len(ranks) == 2, ranks

    rc = interrupt_when_up([DTRUN, "-np", "2", "python", str(script)], 2, two_ranks_running, timeout_exit=20)
    assert rc == 130
    assert wait_until_empty(lambda: processes_with(token)) == [], "rank processes left alive after Ctrl-C"


OMPI4 = "/usr/bin/mpirun.openmpi"
HYDRA = "/usr/bin/mpirun.mpich"
SHOW = "echo rank=$DTRUN_RANK size=$DTRUN_SIZE local=$DTRUN_LOCAL_RANK/$DTRUN_LOCAL_SIZE"


def _other_flavor(path, version_word):
    if not os.path.exists(path):
        pytest.skip(f"{path} not installed (apt-get install {'openmpi-bin' if 'openmpi' in path else 'mpich'})")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    if version_word not in out:
        pytest.skip(f"{path} is not the expected flavor: {out.splitlines()[:1]}")


@pytest.mark.flavor
@pytest.mark.parametrize("path, word, header", [(OMPI4, "4.", "# Open MPI 4."), (HYDRA, "HYDRA", "# MPICH (Hydra)")])
def test_same_launch_with_system_mpi(path, word, header):
    _other_flavor(path, word)
    dry = dtrun("--dry-run", "--mpirun", path, "-np", "2", "-H", "localhost:2", "/bin/sh", "-c", SHOW)
    assert dry.returncode == 0 and dry.stdout.startswith(header), dry.stdout + dry.stderr
    p = dtrun("--mpirun", path, "-np", "2", "-H", "localhost:2", "/bin/sh", "-c", SHOW, timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(re.findall(r"rank=\d size=\d local=\d/\d", p.stdout)) == \
        ["rank=0 size=2 local=0/2", "rank=1 size=2 local=1/2"]
    bad = dtrun("--mpirun", path, "-np", "2", "-H", "localhost:2", "/bin/sh", "-c", 'exit $((DTRUN_RANK + 4))', timeout=60)
    assert bad.returncode != 0
    assert "dtrun: job failed: rank " in bad.stderr
