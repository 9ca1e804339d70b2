"""A rank cannot break its host's agent, and a diagnostic says what it saw.

* A rank's flight recorder file (``rank.N.rec``, which the agent reads for `dtrun top`, the
  straggler finding and the hang report) replaced by a FIFO, by a symbolic link to /dev/zero,
  or truncated while the agent reads it: `dtrun top --once --json` answers within its own
  deadline with every rank of the host, the broken one measured from /proc and named with what
  is wrong with its file; the hang report lists every rank; the agent's memory stays small.
* `dtrun stacks` on a torch.distributed (gloo) + collectives.dp job reads every rank; a rank
  whose SIGRTMIN+6 handler was replaced is not signalled, and the report says what /proc
  showed instead of guessing that Python is shutting down.
* A job stopped by SIGTERM or SIGINT leaves no ``dtrun-sample-*.txt`` of the sampler behind.
"""
import glob
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest

from tests.dtrun_helpers import DTRUN, PYTHON, command_lines, user_env
from tests.test_hang import Job
from tests.test_hardening2_agent import AGENT, DUMP_SIGNAL

# Every process of a job under test (dtrun, mpirun, ranks, agents) gets this much address
# space: an agent that reads /dev/zero without end fails here instead of eating the machine.
AS_LIMIT = 3 << 30

# ------------------------------------------------------------------ 1: a broken flight recorder

# The ranks run collectives until the test says "quiet" (decided together, so both stop after
# the same call), then wait without any: rank 1's recorder file may be gone from under its
# mapping by then, and the job ends with a barrier of MPI's own.
RECORDER_JOB = """import os, sys, time
import numpy as np
from dtrun import collectives
from mpi4py import MPI
c = collectives.init()
x = np.ones(8, np.float32)
for _ in range(3):
    c.allreduce(x)
print("ready", c.rank, flush=True)
flags = sys.argv[1]
while True:
    quiet = np.array([os.path.exists(os.path.join(flags, "quiet"))], np.float32)
    c.allreduce(quiet)
    if quiet[0] > 0:
        break
    time.sleep(0.1)
while not os.path.exists(os.path.join(flags, "go")):
    time.sleep(0.05)  # waiting for the test
MPI.COMM_WORLD.Barrier()
print("done", c.rank, flush=True)
"""

BROKEN = {
    "fifo": "rank.1.rec is a FIFO, not a regular file",
    "dev-zero": "rank.1.rec is a symbolic link, not a regular file",
    "truncated": "rank.1.rec was truncated while read",
}
TOP_DEADLINE_S = 5 + 3 + 8  # top --once: its --timeout, its window, and its margin (launcher/top.py)


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _job_dir(cache):
    found = glob.glob(str(cache / "dtrun" / "jobs" / "*" / "rank.1.rec"))
    assert len(found) == 1, found
    return os.path.dirname(found[0])


def _rank_pid(job_dir, rank):
    with open(os.path.join(job_dir, f"rank.{rank}.json")) as f:
        return json.load(f)["pid"]


def _wait_recorded(pids, timeout=30):
    """Until a sampler's ``py-spy record`` runs on each of ``pids``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cmds = [cmd for _, cmd in command_lines(lambda cmd: "py-spy record" in cmd)]
        if all(any(f"--pid {pid} " in cmd for cmd in cmds) for pid in pids):
            return
        time.sleep(0.05)
    raise AssertionError(f"no sampler on {pids}")


def _truncate_mid_window(rec, pid):
    """Once the sampler's py-spy records rank 1, its flag poller reads the file: truncate it."""
    _wait_recorded([pid])
    time.sleep(0.5)
    os.truncate(rec, 0)


def _ranks_named(report):
    """The rank numbers a stacks report names on its lines ("ranks 0-1 (2 of 2) ...", "rank 1 on ...")."""
    named = set()
    for m in re.finditer(r"^\s+ranks? ([\d,-]+) ", report, re.M):
        for part in m.group(1).split(","):
            lo, _, hi = part.partition("-")
            named.update(range(int(lo), int(hi or lo) + 1))
    return named


def _agent_peak(argv):
    """(the agent's JSON answer, the peak RSS in MiB of it and its children), under AS_LIMIT."""
    measure = ("import json, resource, subprocess, sys\n"
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)\n"
               "print(json.dumps([p.returncode, p.stdout, p.stderr[-2000:],"
               " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n")
    p = subprocess.run([PYTHON, "-c", measure, *argv], capture_output=True, text=True, timeout=180,
                       preexec_fn=_limited)
    rc, out, err, peak_kib = json.loads(p.stdout)
    assert rc == 0 and out.strip(), err
    return json.loads(out.strip().splitlines()[-1]), peak_kib / 1024


def _check_top(v, elapsed, case):
    assert elapsed < TOP_DEADLINE_S - 3, f"top took {elapsed:.1f} s"
    assert [h["error"] for h in v["hosts"]] == [None], v["hosts"]
    ranks = {r["rank"]: r for r in v["ranks"]}
    assert sorted(ranks) == [0, 1] and v["missing"] == [], v
    assert ranks[0]["error"] is None and ranks[0]["via"] == "recorder" and ranks[0]["wait"] is not None, ranks[0]
    broken = ranks[1]
    assert broken["pid"] and broken["rss"] > 0 and broken["cpu"] is not None, broken  # measured from /proc
    assert "flight recorder not read: " + BROKEN[case] in (broken["error"] or ""), broken


def _check_agents(job_dir, case):
    sample, peak = _agent_peak([PYTHON, "-S", AGENT, "sample", job_dir, "1", "10", "proc", "once"])
    dump, peak_dump = _agent_peak([PYTHON, "-S", AGENT, "dump", job_dir, "2", "faulthandler"])
    print(json.dumps([sample, dump, peak, peak_dump], indent=1))
    assert max(peak, peak_dump) < 200, f"the agents grew to {peak:.0f} / {peak_dump:.0f} MiB"
    assert [r["rank"] for r in sample["ranks"]] == [0, 1] and "error" not in sample["ranks"][0], sample
    want = BROKEN[case] if case != "truncated" else "rank.1.rec has 0 bytes, not a recorder's"
    assert want in sample["ranks"][1].get("rec_error", ""), sample
    d = {r["rank"]: r for r in dump["ranks"]}
    assert sorted(d) == [0, 1] and d[0].get("recorder") and d[1].get("threads"), dump
    assert want in d[1].get("recorder_error", ""), dump


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_flight_recorder_file_breaks_neither_top_nor_the_hang_report(tmp_path, case):
    script = tmp_path / "rec_job.py"
    script.write_text(RECORDER_JOB)
    cache = tmp_path / "cache"
    env = user_env(XDG_CACHE_HOME=str(cache))
    job = Job(["prlimit", f"--as={AS_LIMIT}", "--", DTRUN, "--hang-timeout", "5", "--no-tag-output", "-np", "2",
               "-H", "localhost:2", "python", script.name, str(tmp_path)], env, tmp_path)
    try:
        job.wait_for(r"^ready 1$", timeout=90)
        job_dir = _job_dir(cache)
        rec = os.path.join(job_dir, "rank.1.rec")
        (tmp_path / "quiet").write_text("")
        if case != "truncated":
            os.unlink(rec)  # rank 1 keeps writing its mapping of the old file
            os.mkfifo(rec) if case == "fifo" else os.symlink("/dev/zero", rec)
        t0 = time.monotonic()
        top = subprocess.Popen([DTRUN, "top", "--once", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, preexec_fn=_limited)
        if case == "truncated":
            _truncate_mid_window(rec, _rank_pid(job_dir, 1))
        out, err = top.communicate(timeout=120)
        elapsed = time.monotonic() - t0
        print(out, err)
        assert top.returncode == 0, out + err
        _check_top(json.loads(out), elapsed, case)
        job.wait_for(r"^\s+\(collected in ", timeout=60)  # the hang report, printed whole
        _check_agents(job_dir, case)
        report = job.text("err")
        print(report)
        assert "not in this report" not in report and _ranks_named(report) == {0, 1}, report
        with open(re.search(r"full stacks: (\S+)", report).group(1)) as f:
            full = f.read()
        assert "flight recorder not read: rank.1.rec " in full.split("== rank 1 ")[1], full
    finally:
        (tmp_path / "go").write_text("")
        rc = job.finish(timeout=120)
    assert rc == 0, job.text()
    assert sorted(re.findall(r"^done (\d)$", job.text("out"), re.M)) == ["0", "1"]


# ------------------------------------------------------------------ 2: a rank whose handler was replaced

# torch.distributed (gloo) and collectives.dp, training; then rank 0 puts SIGRTMIN+6 back to its
# default action (what a library that resets signal handlers does), and the ranks wait.
TORCH_JOB = """import os, signal, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import dtrun.collectives.dp as dp
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=90))
dp.init()
rank = dist.get_rank()
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
dp.broadcast_parameters(model, root=0)
opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
for step in range(5):
    opt.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    dist.all_reduce(torch.ones(4))
print("trained", rank, flush=True)
flags = sys.argv[1]
while not os.path.exists(os.path.join(flags, "replace")):
    time.sleep(0.05)  # training done
if rank == 0:
    signal.signal(signal.SIGRTMIN + 6, signal.SIG_DFL)
print("replaced", rank, flush=True)
while not os.path.exists(os.path.join(flags, "go")):
    time.sleep(0.05)  # handler replaced
dist.barrier()
dist.destroy_process_group()
print("done", rank, flush=True)
"""


def _stacks(env):
    p = subprocess.run([DTRUN, "stacks"], capture_output=True, text=True, env=env, timeout=90)
    print(p.stdout, p.stderr)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.mark.mpi
def test_stacks_of_a_torch_job_read_every_rank_and_say_what_a_replaced_handler_is(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is not installed")
    from dtrun.launcher.remote import procfs

    script = tmp_path / "torch_job.py"
    script.write_text(TORCH_JOB)
    cache = tmp_path / "cache"
    env = user_env(XDG_CACHE_HOME=str(cache), DTRUN_NO_PYSPY="1")  # faulthandler: the path that failed
    job = Job([DTRUN, "--no-tag-output", "-np", "2", "-H", "localhost:2", "python", script.name, str(tmp_path)],
              env, tmp_path)
    try:
        job.wait_for(r"^trained 1$", count=1, timeout=180)
        job.wait_for(r"^trained 0$", count=1, timeout=60)
        job_dir = _job_dir(cache)
        pids = [_rank_pid(job_dir, r) for r in (0, 1)]
        # Mid-run, after gloo, the runtime's ring and the sampler: every rank still catches the signal.
        assert [procfs.signal_disposition(p, DUMP_SIGNAL) for p in pids] == ["caught", "caught"]
        text = _stacks(env)
        assert re.search(r"^  ranks 0-1 \(2 of 2\) in time\.sleep at torch_job\.py:\d+ \(<module>\)$", text, re.M), text
        (tmp_path / "replace").write_text("")
        job.wait_for(r"^replaced 0$", timeout=60)
        assert procfs.signal_disposition(pids[0], DUMP_SIGNAL) == "default"
        text = _stacks(env)
        rank0 = [line for line in text.splitlines() if re.match(r"\s+rank 0 ", line)]
        assert len(rank0) == 1, text
        assert ("no stack: SIGRTMIN+6 is not caught by the program now (its handler was replaced; "
                "the default action would end the rank)") in rank0[0], rank0
        assert "shutting down" not in text and re.search(r"state [SR] \(\w+\)", rank0[0]), rank0
        assert re.search(r"^  rank 1 .*in time\.sleep at torch_job\.py:\d+ \(<module>\)", text, re.M), text
    finally:
        (tmp_path / "replace").write_text("")
        (tmp_path / "go").write_text("")
        rc = job.finish(timeout=120)
    assert rc == 0, job.text()  # no rank was killed by a dump request
    assert sorted(re.findall(r"^done (\d)$", job.text("out"), re.M)) == ["0", "1"]


# ------------------------------------------------------------------ 3: the sampler leaves no files

WAITS = """import time
from mpi4py import MPI
print("up", MPI.COMM_WORLD.Get_rank(), flush=True)
time.sleep(120)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_job_leaves_no_sample_files(tmp_path, signum):
    """The straggler sampler runs py-spy on every rank; stopping the job mid-window kills it."""
    script = tmp_path / "waits.py"
    script.write_text(WAITS)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache"), TMPDIR=str(tmp))
    job = Job([DTRUN, "--no-tag-output", "-np", "2", "-H", "localhost:2", "python", script.name], env, tmp_path)
    try:
        job.wait_for(r"^up 1$", timeout=90)
        job.wait_for(r"^up 0$", timeout=30)
        job_dir = os.path.dirname(glob.glob(str(tmp_path / "cache" / "dtrun" / "jobs" / "*" / "job.json"))[0])
        _wait_recorded([_rank_pid(job_dir, r) for r in (0, 1)])
        time.sleep(0.5)  # mid-window
        job.proc.send_signal(signum)
        rc = job.finish(timeout=60)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert rc != 0
    time.sleep(3)  # what the killed agents' children still do
    assert [p for p in os.listdir(tmp) if p.startswith("dtrun-sample-")] == []
