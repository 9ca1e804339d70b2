"""The straggler: the rank that makes the others wait is named at the end of the job, and
`dtrun top` shows every rank of a running job.

Pure parts (py-spy's raw output, what counts as waiting, the finding, nvidia-smi's CSV)
are tested on values; the behaviour on real jobs across namespace hosts: 3 hosts x 2
ranks, one rank sleeping longer per step in a named function, with the bundled runtime,
plain mpi4py and torch.distributed (gloo); the same jobs balanced name nobody.
"""
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest

from dtrun.launcher.remote import waitsampler
from dtrun.launcher.jobstate import JobInfo
from dtrun.launcher.straggler import RankTotals, find_straggler, render_finding
from tests.dtrun_helpers import DTRUN, PYTHON, REPO, user_env
from tests.test_hang import Job, host_list, line_of

RUNTIME = str(REPO / "collectives" / "comm.py")
SITE = "/venv/lib/python3.11/site-packages"


# ------------------------------------------------------------------ pure


def test_raw_samples_of_the_main_thread_and_what_counts_as_waiting(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("from mpi4py import MPI\nc = MPI.COMM_WORLD\nc.Barrier()\nx = 1\n")
    raw = (f"thread (41): MainThread;<module> (<string>:22);main ({SITE}/mpi4py/run.py:320);"
           f"<module> ({job}:3) 7\n"
           f"thread (41): MainThread;<module> ({SITE}/mpi4py/run.py:320);<module> ({job}:4) 2\n"
           f"thread (41);<module> ({job}:9);step ({job}:4);"
           f"all_reduce ({SITE}/torch/distributed/distributed_c10d.py:2501) 5\n"
           f"thread (41);<module> ({job}:9);allreduce ({RUNTIME}:380) 4\n"
           f"thread (57): Thread-1;_bootstrap (/usr/lib/python3.11/threading.py:1002) 30\n"
           f"thread (41);<module> ({job}:1);_find_and_load (<frozen importlib._bootstrap>:1176) 50\n"
           f"thread (41);<module> ({job}:2);init_process_group ({SITE}/torch/distributed/c10d_logger.py:9) 60\n")
    samples = waitsampler.parse_raw(raw, 41)
    assert [n for _, n in samples] == [7, 2, 5, 4, 50, 60]  # the other thread is left out
    got = waitsampler.summarise(samples, waitsampler._Source())
    # mpi4py's own launcher frames (python -m mpi4py) around the program are not waiting;
    # c.Barrier() on the user's line is (a compiled call without a frame), as are torch's and the runtime's.
    # Start-up (imports, torch's rendezvous) is left out of the figures.
    assert (got["samples"], got["waiting"]) == (18, 16)
    assert got["frames"][0] == ["<module>", str(job), 3, 7, True]
    assert ["<module>", str(job), 4, 2, False] in got["frames"]


def _totals(shares, hosts=None, frame=("decode_batch", "/job/train.py", 27)):
    out = []
    for r, s in enumerate(shares):
        t = RankTotals(r, (hosts or [f"h{r // 2}" for r in range(len(shares))])[r], samples=100, waiting=int(s * 100))
        t.frames = {(*frame, False): 100 - int(s * 100), ("step", "/job/train.py", 40, True): int(s * 100)}
        out.append(t)
    return out


def test_finding_names_one_rank_with_host_and_function():
    f = find_straggler(_totals([0.61, 0.58, 0.64, 0.03, 0.60, 0.62]))
    assert render_finding(f) == ("straggler: rank 3 on h1 made the others wait 61% of the run (it waited 3%); "
                                 "its time went to decode_batch at train.py:27")


def test_finding_names_a_whole_host():
    f = find_straggler(_totals([0.7, 0.72, 0.02, 0.05, 0.69, 0.71]))
    assert f.whole_host and f.ranks == (2, 3)
    assert render_finding(f).startswith("straggler: host h1 (ranks 2-3) made the others wait 70% of the run "
                                        "(they waited 5%)")


@pytest.mark.parametrize("shares", [
    [0.05, 0.12, 0.02, 0.20, 0.08, 0.15],  # a loaded machine: everyone waits a little, in turns
    [0.30, 0.45, 0.38, 0.25, 0.41, 0.33],  # everyone waits a lot: the collectives are slow, not one rank
    [0.50, 0.35, 0.60, 0.55, 0.45, 0.40],
    # balanced jobs of 6 ranks on 2 cores, each sampled by two agents at once (top's view
    # over 3 s; the live table's over 5): two ranks waited less for a while, by chance
    [0.26, 0.27, 0.15, 0.26, 0.14, 0.25],
    [0.31, 0.30, 0.32, 0.31, 0.15, 0.16],
    [0.0, 0.0],
])
def test_no_finding_when_no_rank_stands_out(shares):
    assert find_straggler(_totals(shares)) is None


def test_too_few_samples_name_nobody():
    ts = _totals([0.7, 0.7, 0.0, 0.7])
    for t in ts:
        t.samples, t.waiting = 5, int(t.waiting / 20)
    assert find_straggler(ts) is None


def test_recorder_flag_and_samples_combine():
    """The larger of the two shares counts: the flag is exact for blocking collectives, the
    samples also see waits on non-blocking handles (where the flag stays clear)."""
    ts = _totals([0.3, 0.05, 0.3, 0.3])
    ts[1].rec_polls, ts[1].rec_inside = 800, 20  # the recorder's flag: set in 2.5 % of the reads
    for t in (ts[0], ts[2], ts[3]):
        t.rec_polls, t.rec_inside = 800, 640
    f = find_straggler(ts)
    assert f.ranks == (1,) and round(f.own_wait, 3) == 0.05 and round(f.others_wait, 2) == 0.8
    ts = _totals([0.7, 0.02, 0.7, 0.7])
    for t in ts:
        t.rec_polls, t.rec_inside = 800, 0  # only non-blocking collectives: the flag never set
    assert find_straggler(ts).ranks == (1,)


def test_nvidia_smi_csv():
    gpus, apps = waitsampler.parse_nvidia_smi(
        "0, GPU-aaa, 97, 30210, 81559\n1, GPU-bbb, [N/A], 10, 81559\n",
        "4242, GPU-aaa, 30100\n4243, GPU-bbb, 9\nbad line\n")
    assert gpus == [{"index": 0, "util": 97.0, "mem_used": 30210.0, "mem_total": 81559.0},
                    {"index": 1, "util": None, "mem_used": 10.0, "mem_total": 81559.0}]
    assert apps == {4242: [(0, 30100.0)], 4243: [(1, 9.0)]}


# ------------------------------------------------------------------ top with a host that does not answer


def test_top_names_a_host_that_does_not_answer_and_does_not_wait_for_it(tmp_path):
    """A host whose sshd greets and then says nothing more (ssh's ConnectTimeout no longer
    applies): top names it and ends by its own deadline, with the other host's answer."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held = []

    def greet():
        while True:
            try:
                conn, _ = silent.accept()
            except OSError:
                return
            conn.sendall(b"SSH-2.0-OpenSSH_9.2p1\r\n")
            held.append(conn)

    threading.Thread(target=greet, daemon=True).start()
    conf = tmp_path / "ssh_config"
    conf.write_text(f"Host hstsilent\n  HostName 127.0.0.1\n  Port {silent.getsockname()[1]}\n"
                    "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n")
    cache = tmp_path / "cache"
    job_dir = cache / "dtrun" / "jobs" / "hstjob"
    job_dir.mkdir(parents=True)
    info = JobInfo("hstjob", str(job_dir), ("localhost", "hstsilent"), 2, os.getpid(), PYTHON, str(conf))
    from dataclasses import asdict

    (job_dir / "job.json").write_text(json.dumps(asdict(info)))
    try:
        p = subprocess.run([DTRUN, "top", "--once", "--json", "--timeout", "2"], capture_output=True, text=True,
                           env=user_env(XDG_CACHE_HOME=str(cache)), timeout=60)
    finally:
        silent.close()
        for conn in held:
            conn.close()
    print(p.stdout, p.stderr)
    assert p.returncode == 1, p.stderr
    v = json.loads(p.stdout)
    hosts = {h["host"]: h for h in v["hosts"]}
    assert hosts["localhost"]["error"] is None
    assert hosts["hstsilent"]["error"].startswith("no answer within"), hosts
    assert v["missing"] == [0, 1] and v["straggler"] is None


def test_top_usage_errors():
    from tests.dtrun_helpers import dtrun, one_line_error

    one_line_error(dtrun("top", "--interval", "0.1"), "--interval 0.1")
    one_line_error(dtrun("top", "no-such-job", env=user_env(XDG_CACHE_HOME="/nonexistent-h8")),
                   "no running dtrun job 'no-such-job'")


# ------------------------------------------------------------------ real jobs on namespace hosts

STEPS = 24
SLOW_S, FAST_S = 0.3, 0.05

RUNTIME_JOB = """import time
import numpy as np
from dtrun import collectives
c = collectives.init()
rank = c.rank
x = np.ones(8, np.float32)
print("up", flush=True)


def decode_batch(step):
    time.sleep(SLOW if rank == WHO else FAST)  # the slow rank's time goes here


for step in range(STEPS):
    decode_batch(step)
    c.allreduce(x)
print("done", rank, flush=True)
"""

MPI4PY_JOB = """import time
from mpi4py import MPI
c = MPI.COMM_WORLD
rank = c.rank
print("up", flush=True)


def decode_batch(step):
    time.sleep(SLOW if rank == WHO else FAST)  # the slow rank's time goes here


for step in range(STEPS):
    decode_batch(step)
    c.Allreduce(MPI.IN_PLACE, bytearray(8), op=MPI.BOR)
print("done", rank, flush=True)
"""

TORCH_JOB = """import gc
import time
from datetime import timedelta
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=90))
rank = dist.get_rank()
x = torch.ones(8)
print("up", flush=True)


def decode_batch(step):
    time.sleep(SLOW if rank == WHO else FAST)  # the slow rank's time goes here


for step in range(STEPS):
    decode_batch(step)
    dist.all_reduce(x)
print("done", rank, flush=True)
dist.barrier()
dist.destroy_process_group()
gc.collect()
"""

JOBS = {"runtime": RUNTIME_JOB, "mpi4py": MPI4PY_JOB, "torch": TORCH_JOB}
SLOW_RANK = 3


def _script(tmp_path, kind, slow, steps=STEPS):
    text = JOBS[kind]
    # Balanced: every rank takes the slow rank's time per step (the job runs as long).
    head = f"SLOW, FAST, WHO, STEPS = {SLOW_S}, {SLOW_S if not slow else FAST_S}, {SLOW_RANK}, {steps}\n"
    lines = text.splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if ln.startswith("print(\"up\""))
    text = "".join(lines[:at] + [head] + lines[at:])
    path = tmp_path / f"{kind}_job.py"
    path.write_text(text)
    return path, text


def _launch(cluster3, script, env, *extra):
    return Job([DTRUN, "--ssh-config", str(cluster3.ssh_config), "-H", host_list(cluster3, [2, 2, 2]),
                "--no-tag-output", *extra, PYTHON, str(script)], env=env, cwd=script.parent)


@pytest.mark.cluster
@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["runtime", "mpi4py", "torch"])
def test_slow_rank_is_named_with_host_and_function(cluster3, tmp_path, kind):
    if kind == "torch":
        pytest.importorskip("torch", reason="PyTorch is not installed")
    script, text = _script(tmp_path, kind, slow=True)
    job = _launch(cluster3, script, user_env(XDG_CACHE_HOME=str(tmp_path / "cache")))
    rc = job.finish(timeout=240)
    err = job.text("err")
    print(err)
    assert rc == 0, err
    assert len(re.findall(r"^done \d", job.text("out"), re.M)) == 6
    host = cluster3.hosts[1].name  # ranks 2 and 3 run on the second host
    sleep_line = line_of(text, "the slow rank's time goes here")
    m = re.search(rf"^dtrun: straggler: rank {SLOW_RANK} on {host} made the others wait (\d+)% of the run "
                  rf"\(it waited (\d+)%\); its time went to decode_batch at {script.name}:{sleep_line}$", err, re.M)
    assert m, err
    assert int(m.group(1)) >= 25 and int(m.group(2)) <= int(m.group(1)) - 20
    report = re.search(r"^  report: (\S+)$", err, re.M).group(1)
    body = open(report).read()
    assert body.startswith(m.group(0)) and f"{script}:{sleep_line} in decode_batch" in body
    rows = re.findall(r"^ +\d+ \S+ +\d+% (\S+) ", body, re.M)
    assert rows == ["recorder" if kind == "runtime" else "py-spy"] * 6, body  # every rank's figures, and how


@pytest.mark.cluster
@pytest.mark.mpi
def test_live_table_flags_the_slow_rank_once_it_lasts(cluster3, tmp_path):
    """`dtrun --top` on the job with one slow rank: the live table comes to flag that rank,
    and only it, while the job runs (it holds a finding back until 4 refreshes in a row
    name the same ranks, and the job runs long enough for that)."""
    script, _ = _script(tmp_path, "mpi4py", slow=True, steps=50)
    job = _launch(cluster3, script, user_env(XDG_CACHE_HOME=str(tmp_path / "cache")), "--top")
    rc = job.finish(timeout=240)
    err = job.text("err")
    print(err)
    assert rc == 0, err
    flags = re.findall(r"^\S+ +(\d) +[RSD] .*  py-spy  ← straggler$", err, re.M)
    assert flags and set(flags) == {str(SLOW_RANK)}, err
    assert re.search(rf"^straggler: rank {SLOW_RANK} on {cluster3.hosts[1].name} made the others wait", err, re.M)


def test_live_finding_is_shown_once_the_same_ranks_are_named_four_refreshes_in_a_row():
    from dtrun.launcher.straggler import Confirmed, Finding

    def f(*ranks):
        return Finding(ranks, ("h",), False, 0.5, 0.0)

    c = Confirmed()
    assert [c(f(3)) for _ in range(3)] == [None] * 3
    assert c(f(3)) == f(3) and c(f(3)) == f(3)
    assert c(f(2, 3)) is None  # other ranks named: counted again from one
    assert c(None) is None and [c(f(3)) for _ in range(3)] == [None] * 3
    assert c(f(3)) == f(3)


def _top_once(env):
    p = subprocess.run([DTRUN, "top", "--once", "--json"], capture_output=True, text=True, env=env, timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)


@pytest.mark.cluster
@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["runtime", "mpi4py", "torch"])
def test_balanced_job_names_nobody_and_top_sees_every_rank(cluster3, tmp_path, kind):
    """The same job with every rank as slow: no finding. `dtrun top --once --json` while it
    runs has every rank, each measured, and the job goes on to exit 0. The mpi4py job runs
    with --top: the live table on dtrun's stderr."""
    if kind == "torch":
        pytest.importorskip("torch", reason="PyTorch is not installed")
    script, _ = _script(tmp_path, kind, slow=False)
    env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    job = _launch(cluster3, script, env, *(["--top"] if kind == "mpi4py" else []))
    job.wait_for(r"^up$", count=6, timeout=150)
    v = _top_once(env)
    print(json.dumps(v, indent=1))
    names = {h.name for h in cluster3.hosts}
    assert sorted(r["rank"] for r in v["ranks"]) == list(range(6)), v
    assert {r["host"] for r in v["ranks"]} == names
    assert all(h["error"] is None for h in v["hosts"]), v["hosts"]
    for r in v["ranks"]:
        assert r["pid"] and r["rss"] > 0 and r["cpu"] is not None and r["wait"] is not None, r
        # The runtime's ranks mark their time inside collectives in the flight recorder;
        # the others are sampled (py-spy). Both give the frame from py-spy's samples.
        assert r["via"] == ("recorder" if kind == "runtime" else "py-spy"), r
        assert r["frame"]["file"] == str(script), r
        assert r["straggler"] is False
        if kind == "runtime":
            assert r["rate"] is not None and r["rate"] > 0, r  # collectives per second from the recorder
    if kind == "runtime":  # the live view, stopped with Ctrl-C: the job goes on
        top = Job([DTRUN, "top", "--interval", "1"], env=env)
        top.wait_for(r"^dtrun top: job .*Ctrl-C leaves the job running$", count=2, timeout=60)
        top.proc.send_signal(signal.SIGINT)
        assert top.finish(timeout=30) == 130, top.text()
        assert job.proc.poll() is None, "the job ended with top"
    rc = job.finish(timeout=240)
    err = job.text("err")
    print(err)
    assert rc == 0, err
    assert "straggler" not in err
    assert len(re.findall(r"^done \d", job.text("out"), re.M)) == 6
    if kind == "mpi4py":
        tables = err.split("dtrun top: job ")[1:]
        assert len(tables) >= 2, err  # refreshed while the job ran
        full = [t for t in tables if sorted(int(m.group(2)) for m in re.finditer(
            r"^(\S+) +(\d) +[RSD] +\d+ +\d+M +- +\d+%  py-spy$", t, re.M)) == list(range(6))]
        assert full, err  # a table with every rank, measured


@pytest.mark.cluster
@pytest.mark.mpi
def test_top_names_a_namespace_host_that_stops_answering_and_does_not_wait_for_it(cluster3, tmp_path):
    """A running job on 3 namespace hosts; the third host's sshd is frozen (SIGSTOP: the
    kernel still accepts connections, nothing answers them, as on a host that hangs).
    `dtrun top --once --json` names that host, answers by its own deadline with the other
    hosts' ranks, and the job (whose sessions on that host were open already) exits 0."""
    script, _ = _script(tmp_path, "mpi4py", slow=False, steps=40)
    env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    job = _launch(cluster3, script, env)
    job.wait_for(r"^up$", count=6, timeout=150)
    frozen = cluster3.hosts[2]
    sshd = int(cluster3._sshd_pidfile(frozen).read_text().split()[0])
    os.kill(sshd, signal.SIGSTOP)
    try:  # ssh itself would wait for the banner for ever: only top's deadline ends this
        p = subprocess.run([DTRUN, "top", "--once", "--json", "--timeout", "3"], capture_output=True,
                           text=True, env=env, timeout=60)
    finally:
        os.kill(sshd, signal.SIGCONT)
    print(p.stdout, p.stderr)
    assert p.returncode == 1, p.stderr
    v = json.loads(p.stdout)
    hosts = {h["host"]: h for h in v["hosts"]}
    # ssh's own ConnectTimeout (it covers the banner) or top's deadline, whichever is first
    assert re.fullmatch(r"no answer within .*|Connection to \S+ port 22 timed out",
                        hosts[frozen.name]["error"]), hosts
    assert all(hosts[h.name]["error"] is None for h in cluster3.hosts[:2]), hosts
    assert sorted(r["rank"] for r in v["ranks"]) == [0, 1, 2, 3]  # the others' ranks, measured
    assert v["missing"] == [4, 5]
    rc = job.finish(timeout=240)
    assert rc == 0, job.text("err")
    assert len(re.findall(r"^done \d", job.text("out"), re.M)) == 6


# ------------------------------------------------------------------ the runtime's flag: the rank marks its time inside

FLAG_JOB = """import sys, time
import numpy as np
from dtrun import collectives
c = collectives.init()
x = np.ones(2, np.float32)  # 8 bytes: the compiled engine's path where it is built
c.allreduce(x)
print("ready", c.rank, flush=True)
if c.rank == 1:
    time.sleep(4)  # rank 0 waits in the allreduce below meanwhile
c.allreduce(x)
c.barrier()
print("done", c.rank, flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("compiled", ["1", "0"])
def test_recorder_flag_is_set_while_the_rank_waits_in_a_collective(tmp_path, compiled):
    """Rank 1 sleeps while rank 0 is in an allreduce: the agent's reads of the flight
    recorder find rank 0 inside and rank 1 not (the compiled engine's store, and Python's)."""
    from dtrun import recorderfile
    from dtrun.launcher.remote import rankstate
    from dtrun.collectives import recorder

    assert recorderfile.VERSION == recorder.VERSION and recorderfile.INSIDE_WORD == recorder.INSIDE_WORD
    script = tmp_path / "flag.py"
    script.write_text(FLAG_JOB)
    env = user_env(DTRUN_JOB_DIR=str(tmp_path), DTRUN_COMPILED=compiled, OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.Popen([str(REPO / ".venv" / "bin" / "mpirun"), "-np", "2", "--oversubscribe", "-x", "DTRUN_JOB_DIR",
                          "-x", "DTRUN_COMPILED", PYTHON, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=tmp_path)
    try:
        ready = 0
        while ready < 2:
            line = p.stdout.readline()
            assert line or p.poll() is None, p.stderr.read()
            ready += line.startswith("ready")
        time.sleep(0.5)
        pids = [rankstate.recorder_words(str(tmp_path), r)[2] for r in (0, 1)]
        until = time.monotonic() + 1.5
        got = {}
        threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, waitsampler.poll_inside(
            str(tmp_path), r, pids[r], until))) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    (polls0, inside0), (polls1, inside1) = got[0], got[1]
    assert polls0 > 50 and inside0 >= 0.9 * polls0, got
    assert polls1 > 50 and inside1 == 0, got
    words = [rankstate.recorder_words(str(tmp_path), r) for r in (0, 1)]
    assert [w[recorderfile.INSIDE_WORD] for w in words] == [0, 0]  # cleared on the way out


def test_top_table_groups_ranks_per_host_beyond_16_and_flags_the_straggler():
    from dtrun.launcher.agentreport import HostSample, RankView, SampledFrame
    from dtrun.launcher.straggler import Recent
    from dtrun.launcher.top import render, view

    job = JobInfo("j1", "/nonexistent", ("a", "b", "c"), 18, 4242)
    recent, latest = Recent(), {}
    for i, host in enumerate(job.hosts):
        ranks = []
        for r in range(6 * i, 6 * i + 6):
            slow = r == 8
            ranks.append(RankView(r, f"node-{host}", pid=100 + r, state="R", cpu=95.0, rss=3 << 30, span=2.0,
                                  colls=40, samples=60, waiting=3 if slow else 45, via="py-spy",
                                  frames=(SampledFrame("decode_batch", "/job/train.py", 27, 38, False),) if slow else
                                  (SampledFrame("<module>", "/job/train.py", 40, 30, True),), gpu_util=88.0,
                                  gpu_mem=30100.0))
        latest[host] = HostSample(host, f"node-{host}", tuple(ranks))
        recent.add(latest[host])
    v = view(job, latest, recent.totals())
    assert [r.rank for r in v.ranks if r.straggler] == [8]
    assert [r["rank"] for r in v.to_json()["ranks"] if r["straggler"]] == [8]
    text = render(v).splitlines()
    assert text[1].split() == ["HOST", "RANK", "STATE", "CPU%", "RSS", "COLL/S", "WAIT", "GPU%", "GPUMEM", "VIA"]
    assert text[2].split() == ["node-a", "0-5", "6", "95", "18432M", "20.0", "75%", "88", "30100M"]
    assert text[3].split()[:2] == ["node-b", "6-11"] and text[3].endswith("← straggler: rank 8")
    assert len(text) == 2 + 3 + 1 + 3 + 1  # header, 3 hosts, "waiting least", 3 ranks, the finding
    assert text[6] == "  rank 8 on node-b: decode_batch at train.py:27"
    assert text[-1].startswith("straggler: rank 8 on node-b made the others wait 75% of the run (it waited 5%)")


def test_odd_sample_lines_are_read_as_far_as_they_go():
    """A sample line's odd fields become absent; its ranks without a number and its frames
    of the wrong shape are left out; a line that is not an object is no sample."""
    from dtrun.launcher.agentreport import SampledFrame, parse_sample

    s = parse_sample({"host": 5, "window": "x", "gpus": {"a": 1}, "ranks": [
        {"rank": 3, "samples": "9", "waiting": 4.0, "rss": float("nan"), "cpu": True, "frames": [
            ["f", "/a.py", 3, 7, 1], ["g", "/b.py", "3", 1, 0], "xxxxx", [1, 2, 3, 4, 5]]},
        {"rank": None}, {"samples": 3}]}, "h1", 2.0)
    assert (s.host, s.name, s.window, s.gpus) == ("h1", "h1", 2.0, ())
    (v,) = s.ranks
    assert (v.rank, v.host, v.samples, v.waiting, v.rss, v.cpu) == (3, "h1", 0, 4, None, None)
    assert v.frames == (SampledFrame("f", "/a.py", 3, 7, True),)
    assert parse_sample([1], "h1", 1.0) is None


def test_start_up_skew_is_not_counted():
    """Ranks that start late make the others wait in their first collective: windows until
    every host is past its start-up are dropped; a later import drops nothing."""
    from dtrun.launcher.agentreport import HostSample, RankView
    from dtrun.launcher.straggler import SteadyState

    def sample(host, at, startup=0):
        return HostSample(host, host, (RankView(0, host, samples=20, waiting=10, startup=startup),), at=at, window=1.0)

    st = SteadyState()
    assert st.admit(sample("a", 1.0)) == (True, False)
    assert st.admit(sample("b", 1.1, startup=15)) == (False, True)  # b still imports: forget a's window
    assert st.admit(sample("a", 1.9)) == (False, False)  # overlapped b's start-up
    assert st.admit(sample("b", 2.2)) == (True, False)
    assert st.admit(sample("a", 3.0)) == (True, False)
    assert st.admit(sample("b", 9.0, startup=3)) == (True, False)  # an import later on: counted as it is
