"""A running job that hangs: dtrun names the rank, the host and the line.

The pure parts (grouping, rank ranges, the recorder's format) are tested on values; the
behaviour on real hangs across namespace hosts (real sshd, real mpirun, real py-spy /
faulthandler / gdb), and under Open MPI 4 and MPICH where they are installed.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from dtrun import recorderfile
from dtrun.launcher.remote import agent as remote_agent, pystacks
from dtrun.launcher.jobstate import JobInfo
from dtrun.launcher.agentreport import parse_dump, parse_watch
from dtrun.launcher.stacks import HostAnswer, collect, format_ranks, roll_call
from tests.dtrun_helpers import DTRUN, PYTHON, REPO, command_lines, start_script_job, user_env, wait_until_empty

RUNTIME = str(REPO / "collectives" / "comm.py")


# ------------------------------------------------------------------ pure


def test_format_ranks():
    assert format_ranks([0, 1, 2, 3, 5, 6, 7]) == "0-3,5-7"
    assert format_ranks([4]) == "4"
    assert format_ranks([2, 0]) == "0,2"


def _rank(n, host, frames, rec=None, **kw):
    return {"rank": n, "host": host, "pid": 100 + n, "alive": True, "state": "S (sleeping)", "source": "py-spy",
            "threads": [{"name": "main", "main": True, "frames": frames}], "recorder": rec or [], **kw}


def _answer(host, ranks):
    """A host's answer from the records its agent would send (parsed as collect parses them)."""
    return HostAnswer(host, parse_dump({"ranks": ranks}, host))


def _in_allreduce(line, seq):
    frames = [{"func": "Comm._allreduce", "file": RUNTIME, "line": 399},
              {"func": "Comm.allreduce", "file": RUNTIME, "line": 371},
              {"func": "step", "file": "/job/train.py", "line": line, "code": "comm.allreduce(g)"}]
    return frames, [{"seq": seq, "op": "allreduce", "dtype": "float32", "count": 8, "root": None}]


def test_roll_call_names_the_odd_rank_and_its_host():
    ranks = []
    for n in (0, 1, 2, 3, 5, 6, 7):
        frames, rec = _in_allreduce(88, 1842)
        ranks.append(_rank(n, f"node{n // 2 + 1}", frames, rec))
    sleeping = [{"func": "load_batch", "file": "/job/data.py", "line": 41, "code": "time.sleep(30)"},
                {"func": "step", "file": "/job/train.py", "line": 80, "code": "batch = load_batch()"}]
    ranks.append(_rank(4, "node3", sleeping, [{"seq": 1841, "op": "allreduce", "dtype": "float32",
                                              "count": 8, "root": None}]))
    text = roll_call([_answer("all", ranks)], "hang: no progress for 30 s.", expected=8)
    assert text.splitlines() == [
        "hang: no progress for 30 s.",
        "  ranks 0-3,5-7 (7 of 8) in allreduce #1842 at train.py:88 (step)",
        "  rank 4 on node3 in time.sleep at data.py:41 (load_batch)   ← not with the others",
    ]


def test_roll_call_mismatched_collective_and_unreachable_host():
    ranks = []
    for n in range(4):
        frames, rec = _in_allreduce(20, 17)
        if n == 2:
            frames[0]["func"], frames[1]["func"] = "Comm._broadcast", "Comm.broadcast"
            rec = [{"seq": 17, "op": "broadcast", "dtype": "float32", "count": 8, "root": 0}]
        if n == 3:
            rec = [{"seq": 17, "op": "allreduce", "dtype": "float32", "count": 16, "root": None}]
        ranks.append(_rank(n, "a", frames, rec))
    text = roll_call([_answer("a", ranks), HostAnswer("b", error="no answer within 4 s")], "hang:")
    assert "  mismatch: rank 2 is in broadcast #17, the others in allreduce #17" in text
    assert "  mismatch: rank 3 is in allreduce #17 with 16 float32, the others with 8 float32" in text
    assert "  b: no answer within 4 s — its ranks are not in this report" in text


def test_odd_fields_from_a_rank_writable_record_never_break_the_report():
    """The agent copies fields from files a rank's program can rewrite: what is missing or of
    the wrong type is read as absent, a record with no rank number is left out."""
    frames, rec = _in_allreduce(20, 5)
    ranks = [{"rank": "1"}, "junk", None,
             {"rank": 0, "host": ["h"], "pid": "12", "alive": "no", "state": 3, "wchan": None, "error": {"x": 1},
              "threads": [{"name": 7, "main": 1, "frames": [{"func": None, "line": "9"}, 4]}, "t"],
              "recorder": [{"seq": "1"}, {"seq": 2, "op": 5, "count": None, "root": "0"}, 3]},
             _rank(2, "h2", frames, rec)]
    got = parse_dump({"ranks": ranks}, "node1")
    assert [r.rank for r in got] == [0, 2]
    odd = got[0]
    assert (odd.host, odd.pid, odd.alive, odd.state, odd.wchan, odd.error) == ("node1", None, True, None, "", None)
    assert [(f.func, f.file, f.line) for f in odd.threads[0].frames] == [("?", "", 0)]
    assert [(e.seq, e.op, e.count, e.root) for e in odd.recorder] == [(2, "", 0, None)]
    assert parse_dump(["not", "an", "object"], "node1") is None
    text = roll_call([HostAnswer("node1", got)], "stacks:", expected=3)
    assert text.splitlines()[0] == "stacks:" and "rank 1: no state on any host" in text


def test_watch_lines_are_read_as_far_as_they_go():
    assert parse_watch({"host": "h", "ranks": {"0": [17, None], "1": [None, 4096], "2": [1], "3": "x"}}) == {
        "0": (17, None), "1": (None, 4096)}
    assert parse_watch({"ranks": [1, 2]}) is None and parse_watch(None) is None


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_recorder_file_is_read_by_the_agent(tmp_path, monkeypatch, compiled):
    """The runtime writes the ring (through the compiled engine's store, or Python's when it
    is off or not built); the standard-library agent decodes the same entries."""
    monkeypatch.setenv("DTRUN_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("DTRUN_COMPILED", compiled)
    import numpy as np
    from dtrun.collectives import comm as comm_mod, recorder

    monkeypatch.setattr(recorder, "OWNER", recorder.Owner())
    c = comm_mod.Comm()
    from dtrun.collectives import shm1
    assert (c._rec_store == c._py_rec_store) == (compiled == "0" or not shm1._fastshm)
    for _ in range(recorder.RING + 3):
        c.allreduce(np.ones(5, np.float64))
    c.broadcast(np.ones(3, np.int32), root=0)
    c.barrier()
    raw = open(recorder.path_for(str(tmp_path), c.rank), "rb").read()
    ours = recorder.decode(raw)["entries"]
    agent = remote_agent.read_recorder(str(tmp_path), c.rank)["entries"]
    assert agent == ours[-remote_agent.REC_SHOWN:]
    assert [(e["seq"], e["op"], e["dtype"], e["count"], e["root"]) for e in agent[-3:]] == [
        (recorder.RING + 3, "allreduce", "float64", 5, None), (recorder.RING + 4, "broadcast", "int32", 3, 0),
        (recorder.RING + 5, "barrier", "", 0, None)]
    assert recorderfile.OPS == recorder.OPS and recorderfile.DTYPES == recorder.DTYPES
    assert recorderfile.MAGIC == recorder.MAGIC
    assert (recorderfile.VERSION, recorderfile.INSIDE_WORD) == (recorder.VERSION, recorder.INSIDE_WORD)
    c.free()


def test_recorder_names_a_non_blocking_op_like_its_blocking_twin(tmp_path, monkeypatch):
    """Each pair shares one set-up, so both forms leave the same entry (under the blocking name)."""
    monkeypatch.setenv("DTRUN_JOB_DIR", str(tmp_path))
    import numpy as np
    from dtrun.collectives import comm as comm_mod, recorder

    monkeypatch.setattr(recorder, "OWNER", recorder.Owner())
    c = comm_mod.Comm()
    x = np.ones(4, np.float32)
    pairs = [(lambda: c.allreduce(x), lambda: c.iallreduce(x).wait()),
             (lambda: c.reduce(x, root=0), lambda: c.ireduce(x, root=0).wait()),
             (lambda: c.broadcast(x, root=0), lambda: c.ibroadcast(x, root=0).wait()),
             (lambda: c.allgather(x), lambda: c.iallgather(x).wait()),
             (lambda: c.reduce_scatter(x), lambda: c.ireduce_scatter(x).wait()),
             (lambda: c.alltoall(x), lambda: c.ialltoall(x).wait())]
    for blocking, nonblocking in pairs:
        blocking()
        nonblocking()
    entries = recorder.decode(open(recorder.path_for(str(tmp_path), c.rank), "rb").read())["entries"]
    got = [(e["op"], e["dtype"], e["count"], e["root"]) for e in entries[-2 * len(pairs):]]
    assert got[0::2] == got[1::2]
    assert [op for op, *_ in got[0::2]] == ["allreduce", "reduce", "broadcast", "allgather", "reduce_scatter",
                                            "alltoall"]
    c.free()


def test_faulthandler_boot_dumps_a_blocked_program(tmp_path):
    """The rank wrapper's boot code arms faulthandler; the agent's signal gets every thread's stack."""
    from dtrun.launcher.remote import rankstate

    script = tmp_path / "blocked.py"
    script.write_text("import threading\n\ndef wait_forever():\n    threading.Event().wait(60)\n\nwait_forever()\n")
    env = dict(user_env(), DTRUN_JOB_DIR=str(tmp_path))
    prog = rankstate.with_stack_dump([PYTHON, "-m", "mpi4py", str(script)], str(tmp_path), 0, env)
    assert prog[1:] == ["-c", rankstate.BOOT, "-m", "mpi4py", str(script)]
    p = subprocess.Popen(prog, env=env, cwd=tmp_path)
    try:
        armed = tmp_path / "rank.0.stack.armed"
        deadline = time.monotonic() + 20
        while not armed.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        threads, err = pystacks.faulthandler_stacks(str(tmp_path), 0, p.pid, 5)
        assert err is None
        main = next(t for t in threads if t["main"])
        ours = [(f["func"], f["line"]) for f in main["frames"] if f["file"].endswith("blocked.py")]
        assert ours == [("wait_forever", 4), ("<module>", 6)]  # innermost first
        assert main["frames"][0]["file"].endswith("threading.py")
        assert p.poll() is None, "the dump must not stop the program"
    finally:
        p.kill()
        p.wait()


def test_unreachable_host_is_named_not_waited_on(tmp_path):
    job = JobInfo("t", str(tmp_path), ("192.0.2.1",), 1, os.getpid())  # TEST-NET-1: never answers
    t0 = time.monotonic()
    answers = collect(job, timeout=2)
    took = time.monotonic() - t0
    assert answers[0].host == "192.0.2.1" and answers[0].error, answers
    assert took < 10, took
    assert "192.0.2.1: " in roll_call(answers, "stacks:")


def test_bad_hang_options_are_usage_errors():
    from tests.dtrun_helpers import dtrun

    p = dtrun("--hang-timeout", "0", "-np", "1", "true")
    assert p.returncode == 2 and "--hang-timeout 0" in p.stderr, p.stderr
    p = dtrun("--hang-timeout", "5", "--on-hang", "explode", "-np", "1", "true")
    assert p.returncode == 2 and "--on-hang 'explode'" in p.stderr, p.stderr
    p = dtrun("stacks", "no-such-job")
    assert p.returncode == 2 and "no running dtrun job 'no-such-job'" in p.stderr, p.stderr


# ------------------------------------------------------------------ real hangs on namespace hosts


def host_list(cluster, slots):
    return ",".join(f"{h.name}:{n}" for h, n in zip(cluster.hosts, slots))


def line_of(text, needle):
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


class Job:
    """dtrun in a subprocess; stdout/stderr lines kept with the time they arrived."""

    def __init__(self, argv, env=None, cwd=None):
        self.lines = []  # (time, stream, line)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env or user_env(), cwd=cwd or REPO, stdin=subprocess.DEVNULL)
        self.readers = [threading.Thread(target=self._read, args=(s, n), daemon=True)
                        for s, n in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for t in self.readers:
            t.start()

    def _read(self, stream, name):
        for line in stream:
            self.lines.append((time.monotonic(), name, line.rstrip("\n")))

    def wait_for(self, pattern, count=1, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for t, _, line in list(self.lines) if re.search(pattern, line)]
            if len(hits) >= count:
                return hits[count - 1]
            if self.proc.poll() is not None:
                time.sleep(0.3)
                hits = [t for t, _, line in list(self.lines) if re.search(pattern, line)]
                if len(hits) >= count:
                    return hits[count - 1]
                break
            time.sleep(0.05)
        raise AssertionError(f"no {count}x {pattern!r}: {self.text()[-3000:]}")

    def finish(self, timeout=60):
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        for t in self.readers:
            t.join(5)
        return rc

    def text(self, stream=None):
        return "\n".join(line for _, s, line in list(self.lines) if stream in (None, s))


def _token_procs(token):
    return command_lines(lambda cmd: token in cmd and "pytest" not in cmd)


# How both runtime programs start: three collectives, then "ready".
RUNTIME_START = """import numpy as np
from dtrun import collectives
c = collectives.init()
x = np.ones(8, np.float32)
for _ in range(3):
    c.allreduce(x)
print("ready", c.rank, flush=True)
"""
RUNTIME_HANG = "import time\n" + RUNTIME_START + """if c.rank == 4:
    time.sleep(300)  # the odd one out
c.allreduce(x)  # where the others wait
print("done", flush=True)
"""


@pytest.mark.cluster
@pytest.mark.mpi
def test_hang_timeout_names_rank_host_and_line_and_abort_leaves_nothing(cluster3, tmp_path):
    token = f"hghang{os.getpid()}{time.monotonic_ns() % 10**6}"
    script = tmp_path / f"{token}.py"
    third = cluster3.hosts[2].name
    # 15 s: six ranks on two cores start MPI, import NumPy and ml_dtypes (about 1 s each on
    # one core) and time the first size of the path table before anything counts as
    # progress; 5 s was too short on a cold cache.
    job = start_script_job(Job, cluster3, tmp_path, script.name, RUNTIME_HANG, [2, 2, 2],
                           "--hang-timeout", "15", "--on-hang", "abort")
    last_ready = job.wait_for(r"ready \d", count=6, timeout=90)
    reported = job.wait_for(r"hang: no progress", timeout=50)
    rc = job.finish()
    err = job.text("err")
    print(err)
    assert rc == 125, err
    assert reported - last_ready <= 15 + 10, f"report {reported - last_ready:.1f} s after the last progress"
    name = script.name
    sleep_line, ar_line = line_of(RUNTIME_HANG, "time.sleep(300)"), line_of(RUNTIME_HANG, "where the others")
    assert f"  ranks 0-3,5 (5 of 6) in allreduce #4 at {name}:{ar_line} (<module>)" in err
    assert f"  rank 4 on {third} in time.sleep at {name}:{sleep_line} (<module>)   ← not with the others" in err
    stacks_file = re.search(r"full stacks: (\S+)", err).group(1)
    full = open(stacks_file).read()
    assert f"== rank 4 on {third}" in full and "#4 allreduce 8 float32" in full
    assert "dtrun: the job made no progress and was stopped (--on-hang abort; exit code 125)" in err
    assert wait_until_empty(lambda: _token_procs(token), timeout=10) == [], "ranks left behind after --on-hang abort"
    assert not list((tmp_path).glob("rank.*")), "job files left in the script's directory"


MISMATCH = RUNTIME_START + """if c.rank == 2:
    c.broadcast(x, root=0)
else:
    c.allreduce(x)
"""


@pytest.mark.cluster
@pytest.mark.mpi
def test_mismatched_collective_is_named_via_faulthandler(cluster3, tmp_path):
    """Without py-spy (DTRUN_NO_PYSPY=1) the ranks' faulthandler answers from inside MPI. The
    runtime's own signature check would name this mismatch at once (MismatchError): it is
    turned off (DTRUN_CHECK=0) so that the job hangs as a program with no such check does."""
    job = start_script_job(Job, cluster3, tmp_path, "mismatch.py", MISMATCH, [1, 1, 1], "--hang-timeout", "4",
                           "--on-hang", "abort", "-x", "DTRUN_CHECK=0", env=user_env(DTRUN_NO_PYSPY="1"))
    rc = job.finish(timeout=120)
    err = job.text("err")
    print(err)
    assert rc == 125, err
    assert "  mismatch: rank 2 is in broadcast #4, the others in allreduce #4" in err
    assert f"  rank 2 on {cluster3.hosts[2].name} in broadcast #4 at mismatch.py:9 (<module>)" in err
    full = open(re.search(r"full stacks: (\S+)", err).group(1)).read()
    assert full.count("via faulthandler") == 3, full


PLAIN = """import time
from mpi4py import MPI
c = MPI.COMM_WORLD
c.Barrier()
print("ready", c.rank, flush=True)
if c.rank == 1:
    time.sleep(14)
c.Barrier()
print("done", c.rank, flush=True)
"""


@pytest.mark.cluster
@pytest.mark.mpi
def test_plain_program_named_by_output_silence_and_report_leaves_it_running(cluster3, tmp_path):
    job = start_script_job(Job, cluster3, tmp_path, "plain.py", PLAIN, [1, 1, 1], "--hang-timeout", "4")
    rc = job.finish(timeout=120)
    err, out = job.text("err"), job.text("out")
    print(err)
    assert rc == 0, err  # --on-hang report: the job goes on and finishes
    assert "hang: no progress for" in err and "(no output from any rank)" in err
    assert "  ranks 0,2 (2 of 3) in c.Barrier at plain.py:8 (<module>)" in err
    assert f"  rank 1 on {cluster3.hosts[1].name} in time.sleep at plain.py:7 (<module>)   ← not with the others" in err
    assert len(re.findall(r"done \d", out)) == 3


HEALTHY = """import time
import numpy as np
from dtrun import collectives
c = collectives.init()
x = np.ones(8, np.float32)
print("up", flush=True)
for _ in range(100):  # about 15 s: long enough for dtrun stacks and then SIGQUIT on a loaded machine
    c.allreduce(x)
    time.sleep(0.15)
print("done", c.rank, flush=True)
"""


@pytest.mark.cluster
@pytest.mark.mpi
def test_stacks_and_sigquit_on_a_healthy_job(cluster3, tmp_path):
    cache = tmp_path / "cache"  # its own cache dir: only this job is running there
    env = user_env(XDG_CACHE_HOME=str(cache))
    job = start_script_job(Job, cluster3, tmp_path, "healthy.py", HEALTHY, [2, 2, 2], "--no-tag-output", env=env)
    job.wait_for(r"^up$", count=6, timeout=90)
    t0 = time.monotonic()
    p = subprocess.run([DTRUN, "stacks"], capture_output=True, text=True, env=env, timeout=60)
    took = time.monotonic() - t0
    print(p.stdout, p.stderr)
    assert p.returncode == 0, p.stdout + p.stderr
    assert took < 15, took
    named = set()
    for m in re.finditer(r"^  ranks? ([\d,-]+) ", p.stdout, re.M):
        for part in m.group(1).split(","):
            a, _, b = part.partition("-")
            named.update(range(int(a), int(b or a) + 1))
    assert named == set(range(6)), p.stdout
    assert "no answer" not in p.stdout and "no stack" not in p.stdout
    job.proc.send_signal(signal.SIGQUIT)
    job.wait_for(r"stacks \(SIGQUIT\): the job goes on", timeout=20)
    assert job.finish(timeout=90) == 0, job.text("err")
    assert len(re.findall(r"^done \d", job.text("out"), re.M)) == 6


C_HANG = r"""#include <mpi.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int rank;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Barrier(MPI_COMM_WORLD);
    printf("ready %d\n", rank);
    fflush(stdout);
    if (rank == 2) sleep(300);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
    return 0;
}
"""
OMPI4, HYDRA = "/usr/bin/mpirun.openmpi", "/usr/bin/mpiexec.mpich"


@pytest.mark.cluster
@pytest.mark.mpi
@pytest.mark.flavor
@pytest.mark.parametrize("mpirun, mpicc, multihost", [(OMPI4, "mpicc.openmpi", True), (HYDRA, "mpicc.mpich", False)])
def test_native_hang_under_system_mpi(request, tmp_path, mpirun, mpicc, multihost):
    """A C program (no Python): named by gdb's stacks, state and wchan, on Open MPI 4 and MPICH.

    MPICH runs on this host only: Hydra's proxies on the namespace hosts connect back to
    this machine's own hostname, which the namespace hosts cannot reach (seen: "unable to
    connect from h2 to vm"), a property of the test cluster rather than of dtrun.
    """
    if not os.path.exists(mpirun) or not shutil.which(mpicc):
        pytest.skip(f"{mpirun} / {mpicc} not installed (apt-get install openmpi-bin libopenmpi-dev mpich libmpich-dev)")
    if not shutil.which("gdb"):
        pytest.skip("gdb not installed: native stacks need it (apt-get install gdb)")
    token = f"hgc{os.getpid()}{time.monotonic_ns() % 10**6}"
    src = tmp_path / "hang.c"
    src.write_text(C_HANG)
    exe = tmp_path / token
    subprocess.run([mpicc, "-g", "-O0", "-o", str(exe), str(src)], check=True, timeout=120)
    if multihost:
        cluster3 = request.getfixturevalue("cluster3")
        third = cluster3.hosts[2].name
        where = ["--ssh-config", str(cluster3.ssh_config), "-H", host_list(cluster3, [1, 1, 1])]
    else:
        import socket

        third = socket.gethostname()
        where = ["-H", "localhost:3"]
    job = Job([DTRUN, "--mpirun", mpirun, *where, "--hang-timeout", "5", "--on-hang", "abort", str(exe)],
              cwd=tmp_path)
    rc = job.finish(timeout=150)
    err = job.text("err")
    print(err)
    assert rc == 125, err
    assert re.search(r"  ranks 0-1 \(2 of 3\) in P?MPI_Barrier at hang\.c:12 \(main\)", err), err
    assert re.search(rf"  rank 2 on {third} in \S*sleep at hang\.c:11 \(main\)   ← not with the others", err), err
    full = open(re.search(r"full stacks: (\S+)", err).group(1)).read()
    assert re.search(rf"== rank 2 on {third} pid \d+ state S \(sleeping\) wchan \S+ via gdb", full), full
    assert wait_until_empty(lambda: _token_procs(token), timeout=10) == []


def test_an_odd_watch_line_does_not_end_the_hosts_watcher(tmp_path):
    """A host agent's watch line that is JSON but not a watch answer (a list, ranks as a list,
    a rank's pair with a string) is skipped: the lines after it still count as progress."""
    from types import SimpleNamespace

    from dtrun.launcher.hangwatch import HangWatch

    watch = HangWatch(JobInfo(id="t", dir=str(tmp_path), hosts=("localhost",), np=2, dtrun_pid=os.getpid()))
    lines = ['[1, 2]\n', '{"ranks": [0, 1]}\n', '{"ranks": {"0": ["x", 5], "1": 7}}\n', 'not json\n',
             '{"ranks": {"0": [3, 10], "1": [null, 4]}}\n']
    watch._read_watch(SimpleNamespace(stdout=iter(lines)))
    assert watch._seen["0"] == [3, 10] and watch._seen["1"] == [None, 4]
