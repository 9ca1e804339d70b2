"""The stack and kill agents never harm a job, and leave nothing of it on a host.

* A stack request (``dtrun stacks``, ``--hang-timeout``, Ctrl-\\) goes to a rank only while
  the rank handles the signal: a rank waiting in MPI_Finalize (Python already removed
  faulthandler), in an atexit handler, or one that unregistered faulthandler itself is
  described from /proc or shown, and the job ends with exit 0.
* The kill agent SIGKILLs only processes proven to be the job's: hostile ``rank.N.json`` and
  ``daemon.PID.json`` files (pid -1, 0, 1, another process's pid, a wrong start time, not an
  integer, huge, a symlink, another job's process) kill nothing. Cases that could reach
  beyond the test (pid -1) run in a pid namespace of their own.
* On hosts that do not share the job directory, the rank wrappers remove the host's
  ``daemon.PID.json`` and the job directory when the job ends; after a failed job whose
  wrappers MPI had to SIGKILL, dtrun's end-of-job tidy step on each host does.
"""
import json
import shutil
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.dtrun_helpers import DTRUN, PYTHON, REPO, user_env
from tests.test_hang import Job

AGENT = str(REPO / "launcher" / "remote" / "agent.py")
HOST = socket.gethostname()
DUMP_SIGNAL = int(signal.SIGRTMIN) + 6


# ------------------------------------------------------------------ 1: a diagnostic never kills a rank

# Rank 1 sleeps (the job looks hung: no output), while rank 0 is where the case puts it.
ENDING = """import atexit
import faulthandler
import os
import signal
import sys
import time
from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
case, release = sys.argv[1], sys.argv[2]  # the test creates ``release`` once it has read the stacks
end = time.monotonic() + 90
print("up", rank, flush=True)


def linger():
    while not os.path.exists(release) and time.monotonic() < end:
        time.sleep(0.1)  # atexit


if rank == 1:
    while not os.path.exists(release) and time.monotonic() < end:
        time.sleep(0.1)  # rank 1
elif case == "atexit":
    atexit.register(linger)
elif case == "unregistered":
    faulthandler.unregister(signal.SIGRTMIN + 6)
    while not os.path.exists(release) and time.monotonic() < end:
        time.sleep(0.1)  # unregistered
# case "finalize": rank 0 ends at once and waits in MPI_Finalize for rank 1
"""


def _line(marker):
    return next(i for i, line in enumerate(ENDING.splitlines(), 1) if line.rstrip().endswith(f"# {marker}"))


NOT_HANDLING = ("no stack: SIGRTMIN+6 is ignored by the program now (faulthandler's handler was removed: "
                "the program unregistered it, or Python is finalizing)")
def _waiting(marker, function):
    """What a stack of a rank in one of ENDING's wait loops says: in the sleep, or (when the
    sample lands between two sleeps) in the loop's check for the release file."""
    return (f"in time.sleep at ending.py:{_line(marker)} ({function})",
            f"in exists at ending.py:{_line(marker) - 1} ({function})")


# What the report says of rank 0, per case and per way of reading stacks (any one of them).
EXPECTED = {
    ("finalize", "py-spy"): (NOT_HANDLING,),  # py-spy cannot read a Python that is shutting down
    ("finalize", "faulthandler"): (NOT_HANDLING,),
    ("atexit", "py-spy"): _waiting("atexit", "linger"),
    ("atexit", "faulthandler"): _waiting("atexit", "linger"),
    ("unregistered", "py-spy"): _waiting("unregistered", "<module>"),
    ("unregistered", "faulthandler"): (NOT_HANDLING,),
}


@pytest.mark.mpi
@pytest.mark.parametrize("via", ["py-spy", "faulthandler"])
@pytest.mark.parametrize("case", ["finalize", "atexit", "unregistered"])
def test_stacks_and_hang_report_leave_an_ending_rank_alone(tmp_path, case, via):
    """The hang report and `dtrun stacks` name rank 0 (its stack, or why there is none and
    its state from /proc), rank 1's stack is there, and the job exits 0: no rank was killed."""
    if via == "py-spy":
        assert os.access(REPO / ".venv" / "bin" / "py-spy", os.X_OK) or os.access(
            os.path.join(os.path.dirname(sys.executable), "py-spy"), os.X_OK), "py-spy is a test dependency"
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache"))  # only this job in its cache
    if via == "faulthandler":
        env["DTRUN_NO_PYSPY"] = "1"
    job = Job([DTRUN, "--hang-timeout", "4", "--no-tag-output", "-np", "2", "-H", "localhost:2", "python",
               script.name, case, tmp_path / "release"], env, tmp_path)
    job.wait_for(r"^\s+\(collected in ", timeout=90)  # the hang report, printed whole
    stacks = subprocess.run([DTRUN, "stacks"], capture_output=True, text=True, env=env, timeout=60)
    (tmp_path / "release").touch()
    rc = job.finish()
    err = job.text("err")
    print(err, stacks.stdout, stacks.stderr, sep="\n")
    assert rc == 0, err
    assert "killed by signal" not in err and "FileNotFoundError" not in err
    assert sorted(re.findall(r"^up (\d)$", job.text("out"), re.M)) == ["0", "1"]
    assert stacks.returncode == 0, stacks.stdout + stacks.stderr
    wants = EXPECTED[(case, via)]
    for name, text in (("hang report", err), ("dtrun stacks", stacks.stdout)):
        rank0 = [line for line in text.splitlines() if re.match(r"\s+rank 0 ", line)]
        assert len(rank0) == 1 and any(w in rank0[0] for w in wants), f"{name}: {rank0}"
        if wants == (NOT_HANDLING,):
            assert re.search(r"state [SRD] \(\w+\)", rank0[0]), f"{name}: no /proc state in {rank0}"
        assert any(w in text for w in _waiting("rank 1", "<module>")), name


CLOSES = """import faulthandler, signal, sys, time
print("armed", flush=True)
sys.stdin.readline()
faulthandler.unregister(signal.SIGRTMIN + 6)
print("closed", flush=True)
time.sleep(60)
"""


def test_a_dump_request_that_loses_the_race_is_dropped(tmp_path):
    """The agent reads SigCgt right before it signals, but the handler can go in between. In a
    rank started by the wrapper's boot code, what faulthandler leaves behind ignores the signal."""
    from dtrun.launcher.remote import rankstate
    from dtrun.launcher.remote import procfs

    script = tmp_path / "closes.py"
    script.write_text(CLOSES)
    env = dict(user_env(), DTRUN_JOB_DIR=str(tmp_path))
    prog = rankstate.with_stack_dump([PYTHON, "-m", "mpi4py", str(script)], str(tmp_path), 0, env)
    p = subprocess.Popen(prog, env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "armed"
        assert procfs.signal_caught(p.pid, DUMP_SIGNAL) is True
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "closed"
        assert procfs.signal_caught(p.pid, DUMP_SIGNAL) is False
        os.kill(p.pid, DUMP_SIGNAL)  # what a request sent just after the handler went does
        time.sleep(0.3)
        assert p.poll() is None, f"the rank died of the dump request ({p.returncode})"
    finally:
        p.kill()
        p.wait()


# ------------------------------------------------------------------ 5: the kill agent kills only the job's

# Runs as pid 1 of a pid namespace of its own (unshare --pid --fork --mount-proc): whatever the
# agent does there, "every process" (-1) is this script's few children. For each case a fresh
# job directory with one real rank of the job (a process started with the job's DTRUN_JOB_DIR,
# recorded as the wrapper records it) and the hostile file; an innocent process (the victim)
# must survive the agent and the rank must not.
HOSTILE = r"""
import json, os, signal, socket, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from dtrun.launcher.remote.procfs import proc_start
from tests.dtrun_helpers import started

base, agent = sys.argv[2], sys.argv[3]
host = socket.gethostname()
start = lambda pid: proc_start(pid)[1]


def sleeper(job_dir=None, argv=("sleep", "300")):
    env = dict(os.environ)
    env.pop("DTRUN_JOB_DIR", None)
    if job_dir:
        env["DTRUN_JOB_DIR"] = job_dir
    return started(list(argv), env=env)  # exec done: the agent reads DTRUN_JOB_DIR in its environment


def rank_file(job_dir, rank, **fields):
    with open(os.path.join(job_dir, f"rank.{rank}.json"), "w") as f:
        json.dump({"rank": rank, "host": host, "argv": ["x"], "log": None, **fields}, f)


def case_files(name, job_dir, v, other):
    vs = start(v.pid)
    if name == "symlinked rank file":
        outside = os.path.join(base, "outside.json")
        with open(outside, "w") as f:
            json.dump({"rank": 5, "host": host, "pid": v.pid, "start": vs}, f)
        os.symlink(outside, os.path.join(job_dir, "rank.5.json"))
        return
    if name.startswith("daemon"):
        pid = {"daemon file naming an unrelated process": v.pid, "daemon file with pid -1": -1,
               "daemon file with pid 1": 1}[name]
        info = proc_start(pid) or ("sleep", 0)
        with open(os.path.join(job_dir, f"daemon.{pid}.json"), "w") as f:
            json.dump({"host": host, "pid": pid, "name": info[0], "start": info[1]}, f)
        return
    fields = {
        "pid -1": {"pid": -1, "start": 0},
        "pid 0": {"pid": 0, "start": 0},
        "pid 1": {"pid": 1, "start": start(1)},
        "another process's pid and start time": {"pid": v.pid, "start": vs},
        "another process as wrapper_pid": {"wrapper_pid": v.pid, "wrapper_start": vs},
        "start time differs": {"pid": v.pid, "start": vs + 1},
        "pid as a string": {"pid": str(v.pid), "start": vs},
        "pid as a float": {"pid": float(v.pid), "start": vs},
        "pid as true": {"pid": True, "start": start(1)},
        "huge pid 2**64": {"pid": 2 ** 64, "start": 0},
        "huge pid 10**30": {"pid": 10 ** 30, "start": 0},
        "another job's process": {"pid": other.pid, "start": start(other.pid)},
    }[name]
    rank_file(job_dir, 3, **fields)


CASES = json.loads(sys.argv[4])
result = {}
for i, name in enumerate(CASES):
    job_dir = os.path.join(base, f"job{i}")
    os.makedirs(job_dir)
    victim = sleeper()
    other = sleeper(os.path.join(base, "another-job"))
    rank = sleeper(job_dir)
    rank_file(job_dir, 0, pid=rank.pid, start=start(rank.pid))
    case_files(name, job_dir, victim, other)
    # Its own session, as dtrun starts it (pid 0 would be its process group).
    p = subprocess.run([sys.executable, "-S", agent, "kill", job_dir], capture_output=True, text=True,
                       timeout=60, start_new_session=True)
    out = json.loads(p.stdout) if p.returncode == 0 and p.stdout.strip() else {"stderr": p.stderr[-500:]}
    try:
        rank_rc = rank.wait(timeout=10)
    except subprocess.TimeoutExpired:
        rank_rc = None
    time.sleep(0.3)  # a SIGKILL sent with the rank's is delivered by now
    result[name] = {"agent_rc": p.returncode, "agent": out, "rank_rc": rank_rc,
                    "victim_alive": victim.poll() is None, "other_job_alive": other.poll() is None,
                    "victim": victim.pid}
    for proc in (victim, other, rank):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
print(json.dumps(result))
"""

HOSTILE_CASES = [
    "pid -1", "pid 0", "pid 1", "another process's pid and start time", "another process as wrapper_pid",
    "start time differs", "pid as a string", "pid as a float", "pid as true", "huge pid 2**64",
    "huge pid 10**30", "symlinked rank file", "another job's process", "daemon file naming an unrelated process",
    "daemon file with pid -1", "daemon file with pid 1",
]


def _in_own_pid_namespace(argv, timeout=300):
    # A session of its own too: a process group reaches across pid namespaces (kill(0, ...)).
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *argv], capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


@pytest.fixture
def pid_namespace():
    if os.geteuid() != 0:
        pytest.skip("a pid namespace of its own needs root")
    probe = _in_own_pid_namespace(["true"], timeout=30)
    if probe.returncode != 0:
        pytest.fail(f"unshare --pid --fork --mount-proc: {probe.stderr.strip()}")


def test_kill_agent_refuses_hostile_job_files(tmp_path, pid_namespace):
    """Every hostile file leaves the innocent process alive, the agent answers (exit 0, JSON),
    kills the job's real rank, and names nothing it was not sure of in ``killed``."""
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    p = _in_own_pid_namespace([PYTHON, str(script), str(REPO), str(tmp_path), AGENT,
                               json.dumps(HOSTILE_CASES)])
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    bad = {}
    for name in HOSTILE_CASES:
        r = result[name]
        problems = []
        if r["agent_rc"] != 0:
            problems.append(f"agent failed: {r['agent']}")
        if not r["victim_alive"]:
            problems.append("innocent process killed")
        if not r["other_job_alive"]:
            problems.append("another job's process killed")
        if r["rank_rc"] != -signal.SIGKILL:
            problems.append(f"the job's rank not killed ({r['rank_rc']})")
        killed = r["agent"].get("killed", [])
        if any(k != killed[0] for k in killed) or len(killed) != 1:
            problems.append(f"killed {killed}, not the rank alone")
        if problems:
            bad[name] = problems
    assert not bad, bad
    # What the agent says of what it refused (pids it cannot see as processes are just skipped).
    named = result["another process's pid and start time"]
    assert named["agent"]["refused"] == [f"rank 3: pid {named['victim']} is not a process of this job "
                                         "(DTRUN_JOB_DIR is not in its environment)"], named


def test_dump_agent_does_not_signal_a_process_a_rank_file_names(tmp_path):
    """A rank file (and .armed file) naming an innocent Python process: the stack agent neither
    signals it (SIGRTMIN+6 would kill it) nor attaches to it, and says why."""
    from dtrun.launcher.remote.procfs import proc_start

    job_dir = tmp_path / "job"
    job_dir.mkdir()
    victim = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(120)"], env=user_env())
    try:
        start = proc_start(victim.pid)[1]
        (job_dir / "rank.0.json").write_text(json.dumps({"rank": 0, "host": HOST, "pid": victim.pid, "start": start}))
        (job_dir / "rank.0.stack").write_text("")
        (job_dir / "rank.0.stack.armed").write_text(f"{victim.pid} {DUMP_SIGNAL}\n")
        p = subprocess.run([PYTHON, "-S", AGENT, "dump", str(job_dir), "2", "faulthandler"], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        ranks = json.loads(p.stdout)["ranks"]
        time.sleep(0.3)  # a signal sent would have been delivered
        assert victim.poll() is None, f"the agent killed pid {victim.pid}: {ranks}"
        assert [r["error"] for r in ranks] == [f"not examined: pid {victim.pid} is not a process of this job "
                                               "(DTRUN_JOB_DIR is not in its environment)"], ranks
    finally:
        victim.kill()
        victim.wait()


# Rank 0 writes a state file for a rank that does not exist, naming a process the test started
# (with its true start time), then every rank waits: --on-hang abort stops the job and runs the
# kill agent on the host.
IMPOSTOR = """import json, os, socket, sys, time
from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
if rank == 0:
    victim, start = int(sys.argv[1]), int(sys.argv[2])
    path = os.path.join(os.environ["DTRUN_JOB_DIR"], "rank.99.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": 99, "host": socket.gethostname(), "pid": victim, "start": start}, f)
    os.replace(path + ".tmp", path)
print("up", rank, flush=True)
time.sleep(300)
"""


@pytest.mark.mpi
def test_stopped_job_whose_rank_names_another_process_leaves_it_alive(tmp_path):
    from dtrun.launcher.remote.procfs import proc_start

    script = tmp_path / "impostor.py"
    script.write_text(IMPOSTOR)
    victim = subprocess.Popen(["sleep", "300"])
    try:
        env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
        job = Job([DTRUN, "--hang-timeout", "3", "--on-hang", "abort", "--no-tag-output", "-np", "2", "-H",
                   "localhost:2", "python", script.name, str(victim.pid), str(proc_start(victim.pid)[1])],
                  env, tmp_path)
        rc = job.finish(timeout=120)
        err = job.text("err")
        print(err)
        assert rc == 125, err  # --on-hang abort
        assert sorted(re.findall(r"^up (\d)$", job.text("out"), re.M)) == ["0", "1"]
        time.sleep(0.3)
        assert victim.poll() is None, "dtrun's kill agent SIGKILLed a process that is not the job's"
    finally:
        victim.kill()
        victim.wait()


# ------------------------------------------------------------------ 12: hosts without a shared job directory

def _own_job_directories(cluster, cache):
    """Give each host of ``cluster`` its own ``cache`` directory, as hosts without a shared file
    system have: its sshd (and so everything dtrun starts there) runs in a mount namespace of
    its own with an empty tmpfs over ``cache``. The namespace hosts otherwise share one tree."""
    from tests.nscluster import SSHD

    for host in cluster.hosts:
        cluster._stop_sshd(host)
        subprocess.run(["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount", "--propagation", "private",
                        "--", "sh", "-c", 'mount -t tmpfs -o mode=0700 dtrun-own "$2" && hostname "$1" && shift 2 '
                        '&& exec "$@"', "sh", host.name, str(cache), SSHD, "-f", str(cluster._sshd_config(host)),
                        "-E", str(cluster.workdir / f"sshd_{host.name}.log")], check=True, timeout=30,
                       capture_output=True)
    cluster._wait_sshd(cluster.hosts)


def _left_on(cluster, host, cache):
    p = subprocess.run(["ssh", "-F", str(cluster.ssh_config), host.name, "find", str(cache), "-mindepth", "1"],
                       capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    return sorted(p.stdout.split())


LEAVES = """import os, sys, time
from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
print("up", rank, flush=True)
while not os.path.exists(sys.argv[2]):  # the test looked at the hosts
    time.sleep(0.05)
if sys.argv[1] != "ok":
    if rank == 3:
        sys.exit(3)
    if sys.argv[1] == "fail-stubborn":  # the others ignore SIGTERM: MPI has to SIGKILL their wrappers
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
"""


@pytest.mark.cluster
@pytest.mark.mpi
def test_hosts_without_a_shared_job_directory_keep_nothing_of_the_job(make_cluster, tmp_path):
    """Each host's rank wrappers write the daemon file and rank files into the host's own job
    directory; when the job ends, normally or with a failed rank, none of it stays there."""
    cluster = make_cluster(2)
    cache = tmp_path / "cache"
    cache.mkdir()
    _own_job_directories(cluster, cache)
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES)
    env = user_env(XDG_CACHE_HOME=str(cache))
    hosts = ",".join(f"{h.name}:2" for h in cluster.hosts)
    jobs = str(cache / "dtrun" / "jobs") + os.sep
    for outcome, want_rc in (("ok", 0), ("fail", 3), ("fail-stubborn", 3)):
        go = tmp_path / f"go-{outcome}"
        job = Job([DTRUN, "--ssh-config", str(cluster.ssh_config), "-H", hosts, "--no-tag-output", "python",
                   str(script), outcome, str(go)], env, tmp_path)
        job.wait_for(r"^up 3$", timeout=120)
        job.wait_for(r"^up 0$", timeout=60)
        # While the job runs, each host has a job directory of its own with its daemon's file.
        during = {h.name: _left_on(cluster, h, cache) for h in cluster.hosts}
        go.write_text("")
        rc = job.finish(timeout=120)
        print(outcome, during, job.text("err"), sep="\n")
        assert rc == want_rc, job.text("err")
        for name, files in during.items():
            assert [os.path.basename(f) for f in files if os.path.basename(f).startswith("daemon.")], (name, files)
        for h in cluster.hosts:
            left = _left_on(cluster, h, cache)
            assert [f for f in left if os.path.basename(f).startswith("daemon.")] == [], (outcome, h.name, left)
            assert [f for f in left if f.startswith(jobs)] == [], (outcome, h.name, left)


def test_kill_agent_proves_an_open_mpi_5_daemon_whose_ranks_ended_by_its_namespace(tmp_path):
    """After Ctrl-C the ranks may be gone while their daemon lingers: no rank is left to prove it
    the job's. dtrun passes the job's PMIx namespace (this host, mpirun's pid); a daemon started
    with it is killed, one of another namespace is left alone."""
    from dtrun.launcher.remote.procfs import proc_start

    prted = tmp_path / "prted"  # a process named like PRRTE's daemon, with its command line
    shutil.copy(sys.executable, prted)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    code = "import time; time.sleep(120)"
    ours = subprocess.Popen([str(prted), "-S", "-c", code, "--prtemca", "ess_base_nspace", "prterun-h1-4242@0"])
    other = subprocess.Popen([str(prted), "-S", "-c", code, "--prtemca", "ess_base_nspace", "prterun-h1-4343@0"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all((proc_start(p.pid) or ("",))[0] == "prted" for p in (ours, other)):
            time.sleep(0.05)
        for p in (ours, other):
            name, start = proc_start(p.pid)
            (job_dir / f"daemon.{p.pid}.json").write_text(json.dumps(
                {"host": socket.gethostname(), "pid": p.pid, "name": name, "start": start}))
        out = subprocess.run([PYTHON, "-S", AGENT, "kill", str(job_dir), "2", "prterun-h1-4242@0"],
                             capture_output=True, text=True, timeout=60, start_new_session=True)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["killed"] == [ours.pid]
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for p in (ours, other):
            if p.poll() is None:
                p.kill()
                p.wait()
