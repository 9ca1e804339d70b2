"""Clean-up seen from another pid namespace (launcher/remote/sessiondirs.py, launcher/jobstate.py).

A container, or a second login node, can share this machine's /tmp and home while its
processes live in another pid namespace: there a live job's pids name nothing (or someone
else). Deciding by pid alone, `dtrun stacks` there removed a running job's directory and a
sweep there removed a running mpirun's and prted's session directories. Liveness is now an
flock that every namespace sees. These tests run real jobs and real sweeps and `dtrun
stacks` under ``unshare --pid --fork --mount-proc``, and hold locks from processes inside
another pid namespace.
"""
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrun.launcher.remote import sessiondirs
from tests.dtrun_helpers import DTRUN, PYTHON, REPO, user_env
from tests.test_sessiondirs import dead_pid, make_stale, needs_ompi5

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]
# The lock files' names, spelled out (launcher/remote/sessiondirs.LOCK_NAME, launcher/jobstate.LOCK_NAME).
SESSION_LOCK, JOB_LOCK = "dtrun.lock", "job.lock"
WAIT_S = 60  # a bound on waiting for a job to reach a state, never a measured time


def _unshare_works() -> bool:
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def other_pidns():
    """``unshare --pid`` works here: as root it must (a failure is a set-up defect)."""
    if not _unshare_works():
        if os.geteuid() == 0:
            pytest.fail("unshare --pid --fork --mount-proc fails as root: install util-linux's unshare")
        pytest.skip("unshare --pid needs root")


def in_other_pidns(argv, **kw):
    """Run ``argv`` in a new pid namespace with its own /proc (what a container sees)."""
    return subprocess.run([*UNSHARE, *argv], capture_output=True, text=True, timeout=120, **kw)


class ForeignHolder:
    """A process in another pid namespace that holds the lock of ``path`` until closed; it
    reports its pid namespace (what a dtrun there writes in its job record)."""

    def __init__(self, path):
        code = ("import fcntl, os, sys\n"
                "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "print(os.getpid(), os.readlink('/proc/self/ns/pid'), flush=True)\n"
                "sys.stdin.read()\n")
        self.proc = subprocess.Popen([*UNSHARE, PYTHON, "-c", code, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        pid, self.pid_ns = self.proc.stdout.readline().split()
        self.inner_pid = int(pid)
        assert self.pid_ns != os.readlink("/proc/self/ns/pid")

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def test_session_dirs_locked_in_another_pid_namespace_are_kept(other_pidns, tmp_path):
    """A directory whose pid is dead here but whose lock a process of another pid namespace
    holds is kept; so are those without our lock file (a bare mpirun's) or with a lock file
    that is not ours, and one whose lock is free but whose pid lives (its holder ended
    first). The provably dead one (our free lock, pid gone) is removed."""
    theirs = make_stale(tmp_path, "ompi", dead_pid())
    holder = ForeignHolder(os.path.join(theirs, SESSION_LOCK))
    try:
        bare = make_stale(tmp_path, "prted", dead_pid(), lock=False)
        dead = make_stale(tmp_path, "prted", dead_pid())
        holder_gone = make_stale(tmp_path, "ompi", os.getpid())  # free lock, live pid
        link = make_stale(tmp_path, "ompi", dead_pid(), lock=False)
        free_elsewhere = tmp_path / "free.lock"
        free_elsewhere.write_text("")
        os.symlink(free_elsewhere, os.path.join(link, SESSION_LOCK))  # never followed
        fifo = make_stale(tmp_path, "ompi", dead_pid(), lock=False)
        os.mkfifo(os.path.join(fifo, SESSION_LOCK))  # not a regular file (and opening it must not block)
        foreign = make_stale(tmp_path, "prted", dead_pid())
        os.chown(os.path.join(foreign, SESSION_LOCK), 65534, 65534)  # someone else's lock file
        assert sessiondirs.stale(str(tmp_path)) == [dead]
        assert sessiondirs.sweep({"TMPDIR": str(tmp_path)}) == [dead]
        for kept in (theirs, bare, holder_gone, link, fifo, foreign):
            assert os.path.isdir(kept), kept
        assert not os.path.exists(dead)
    finally:
        holder.close()
    # Its holder gone (that job ended, killed) and its pid dead: now it is removed.
    assert sessiondirs.sweep({"TMPDIR": str(tmp_path)}) == [theirs]


def _plant_job(cache, name, dtrun_pid, lock=True, **fields):
    """A job record as a dtrun writes it (launcher/jobstate.py), with ``fields`` overriding."""
    d = Path(cache) / "dtrun" / "jobs" / name
    d.mkdir(parents=True)
    info = {"id": name, "dir": str(d), "hosts": ["localhost"], "np": 2, "dtrun_pid": dtrun_pid,
            "python": sys.executable, "program": ["python", "train.py"], "started": time.time(), **fields}
    (d / "job.json").write_text(json.dumps(info))
    if lock:
        (d / JOB_LOCK).write_text("")
    return d


def test_stacks_leaves_a_job_of_another_pid_namespace_and_names_it(other_pidns, tmp_path):
    """`dtrun stacks` keeps the record of a job whose dtrun runs in another pid namespace (its
    lock held there, its pid nothing here) and says where it runs; it removes a dead record
    (free lock, pid gone) and keeps one without a lock file or whose pid lives on."""
    cache = tmp_path / "cache"
    theirs = _plant_job(cache, "20300101-000000-1", dead_pid(), dtrun_start=12345)
    holder = ForeignHolder(theirs / JOB_LOCK)
    try:
        record = json.loads((theirs / "job.json").read_text())
        (theirs / "job.json").write_text(json.dumps({**record, "pid_ns": holder.pid_ns}))
        dead = _plant_job(cache, "20300101-000001-2", dead_pid())
        unlocked = _plant_job(cache, "20300101-000002-3", dead_pid(), lock=False)
        # dtrun's pid given to another process since: start time differs, lock free.
        reused = _plant_job(cache, "20300101-000003-4", os.getpid(), dtrun_start=1)
        # Another login node's (a shared home): judged there only, whatever flock says here.
        other_node = _plant_job(cache, "20300101-000004-5", dead_pid(), launch_host="login2.example")
        p = subprocess.run([DTRUN, "stacks"], capture_output=True, text=True, timeout=60,
                           env=user_env(XDG_CACHE_HOME=str(cache)), cwd=REPO, stdin=subprocess.DEVNULL)
        assert p.returncode == 2, (p.stdout, p.stderr)
        assert p.stderr.startswith("dtrun: error: no running dtrun job found") and p.stderr.count("\n") == 1, p.stderr
        assert f"{theirs.name}, dtrun pid {record['dtrun_pid']} in another pid namespace, {holder.pid_ns}" \
            in p.stderr, p.stderr
        assert "run dtrun stacks where the job runs" in p.stderr
        p = subprocess.run([DTRUN, "top", "--once"], capture_output=True, text=True, timeout=60,
                           env=user_env(XDG_CACHE_HOME=str(cache)), cwd=REPO, stdin=subprocess.DEVNULL)
        assert p.returncode == 2 and "run dtrun top where the job runs" in p.stderr, p.stderr
        p = subprocess.run([DTRUN, "stacks", theirs.name], capture_output=True, text=True, timeout=60,
                           env=user_env(XDG_CACHE_HOME=str(cache)), cwd=REPO, stdin=subprocess.DEVNULL)
        assert p.returncode == 2 and f"dtrun job {theirs.name} runs in another pid namespace" in p.stderr, p.stderr
        for kept in (theirs, unlocked, reused, other_node):
            assert (kept / "job.json").is_file(), kept
        assert not dead.exists()
    finally:
        holder.close()


def _wait_for(cond, what):
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.1)


def _sweep_argv(top):
    return [PYTHON, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from dtrun.launcher.remote import sessiondirs; "
                          "print(len(sessiondirs.sweep({'TMPDIR': sys.argv[2]})))", str(REPO), str(top)]


_RANK = ("import os, sys, time\n"
         "d = sys.argv[1]\n"
         "open(os.path.join(d, 'started.' + os.environ['DTRUN_RANK']), 'w').close()\n"
         "while not os.path.exists(os.path.join(d, 'go')):\n"
         "    time.sleep(0.1)\n"
         "print('finished', os.environ['DTRUN_RANK'])\n")


def _start_job(argv, flags, env):
    return subprocess.Popen([DTRUN, *flags, PYTHON, "-c", _RANK, str(argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def _waiting_job(sync, flags, env):
    """A dtrun job of two ranks that wait for SYNC/go: yields its Popen once both ranks have
    started; on leaving, lets them finish and keeps what it printed in ``.out`` and ``.err``."""
    job = _start_job(sync, flags, env)
    job.out = job.err = ""
    try:
        _wait_for(lambda: len(list(sync.glob("started.*"))) == 2 or job.poll() is not None, "both ranks")
        assert job.poll() is None, job.communicate()
        yield job
    finally:
        (sync / "go").touch()
        job.out, job.err = job.communicate(timeout=120)


@pytest.mark.mpi
@needs_ompi5
def test_a_running_job_survives_stacks_and_a_sweep_from_another_pid_namespace(other_pidns, tmp_path):
    """A real job (Open MPI 5, two ranks on this machine that wait): `dtrun stacks` and a
    session-directory sweep run in another pid namespace leave its job directory and
    mpirun's ompi.PID alone, and the job ends well."""
    top, cache, sync = tmp_path / "tmp", tmp_path / "cache", tmp_path / "sync"
    for d in (top, cache, sync):
        d.mkdir()
    env = user_env(TMPDIR=str(top), XDG_CACHE_HOME=str(cache))
    with _waiting_job(sync, ["-np", "2"], env) as job:
        job_dirs = list((cache / "dtrun" / "jobs").iterdir())
        sessions = list(top.glob("ompi.*"))
        assert len(job_dirs) == 1 and len(sessions) == 1, (job_dirs, sessions)
        lock = sessions[0] / SESSION_LOCK
        deadline = time.monotonic() + WAIT_S  # dtrun takes the lock once a rank has started
        while not lock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        stacks = in_other_pidns([DTRUN, "stacks"], env=env, cwd=REPO, stdin=subprocess.DEVNULL)
        sweep = in_other_pidns(_sweep_argv(top), env=env)
        assert job_dirs[0].is_dir() and (job_dirs[0] / "job.json").is_file(), "the job's record was removed"
        assert sessions[0].is_dir(), "mpirun's live session directory was removed"
        assert sweep.returncode == 0 and sweep.stdout.split() == ["0"], (sweep.stdout, sweep.stderr)
        assert stacks.returncode == 2, (stacks.stdout, stacks.stderr)
        assert f"{job_dirs[0].name}, dtrun pid {job.pid} in another pid namespace" in stacks.stderr, stacks.stderr
    out, err = job.out, job.err
    assert job.returncode == 0, err
    assert sorted(l for l in out.splitlines() if "finished" in l) == ["finished 0", "finished 1"], out
    assert not list(top.glob("ompi.*")) and not list((cache / "dtrun" / "jobs").iterdir())


def _cluster_dirs(tmp_path):
    """This machine's TMPDIR, the daemons' remote tmpdir and the ranks' sync folder, made
    under ``tmp_path``; and the environment that uses them."""
    top, remote_top, sync = tmp_path / "tmp", tmp_path / "remote", tmp_path / "sync"
    for d in (top, remote_top, sync):
        d.mkdir()
    return top, remote_top, sync, user_env(TMPDIR=str(top), XDG_CACHE_HOME=str(tmp_path / "cache"))


def _cluster_flags(cluster, remote_top):
    hosts = [h.name for h in cluster.hosts[:2]]
    # The daemons' session directories go to a directory of this test's (PRRTE's remote
    # tmpdir), and the ranks' wrappers look there (TMPDIR): no other job's are touched.
    return ["--ssh-config", str(cluster.ssh_config), "-H", ",".join(f"{h}:1" for h in hosts),
            "--mpi-args", f"--prtemca prte_remote_tmpdir_base {remote_top}", "-x", f"TMPDIR={remote_top}"]


@pytest.mark.cluster
@pytest.mark.mpi
@needs_ompi5
def test_remote_daemons_dirs_survive_a_sweep_from_another_pid_namespace(other_pidns, cluster3, tmp_path):
    """Two namespace hosts (they share this /tmp, as hosts of one machine): each prted.PID is
    locked by its keeper for the daemon's life, so a sweep from another pid namespace keeps
    them and mpirun's ompi.PID; the job ends well, and nothing of it is left."""
    top, remote_top, sync, env = _cluster_dirs(tmp_path)
    with _waiting_job(sync, _cluster_flags(cluster3, remote_top), env) as job:
        daemons = list(remote_top.glob("prted.*"))
        assert len(daemons) == 2 and len(list(top.glob("ompi.*"))) == 1, (daemons, list(top.iterdir()))
        deadline = time.monotonic() + WAIT_S  # the keepers start beside the ranks
        while not all((d / SESSION_LOCK).exists() for d in daemons) and time.monotonic() < deadline:
            time.sleep(0.1)
        for where in (remote_top, top):
            sweep = in_other_pidns(_sweep_argv(where), env=env)
            assert sweep.returncode == 0 and sweep.stdout.split() == ["0"], (where, sweep.stdout, sweep.stderr)
        assert all(d.is_dir() for d in daemons) and len(list(top.glob("ompi.*"))) == 1
    out, err = job.out, job.err
    assert job.returncode == 0, err
    assert sorted(l.split("finished")[1] for l in out.splitlines() if "finished" in l) == [" 0", " 1"], out
    _wait_for(lambda: not list(remote_top.iterdir()), "the daemons' directories to go (their keepers end with them)")


@pytest.mark.cluster
@pytest.mark.mpi
@needs_ompi5
def test_a_killed_daemons_dir_is_removed_by_its_keeper(cluster3, tmp_path):
    """The original purpose kept: a prted killed with SIGKILL leaves prted.PID (which would
    make PMIx refuse a later daemon given that pid); its keeper removes it."""
    top, remote_top, sync, env = _cluster_dirs(tmp_path)
    with _waiting_job(sync, _cluster_flags(cluster3, remote_top), env) as job:
        daemons = sorted(remote_top.glob("prted.*"))
        assert len(daemons) == 2, daemons
        victim = daemons[0]
        deadline = time.monotonic() + WAIT_S
        while not (victim / SESSION_LOCK).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(int(victim.name.split(".")[1]), 9)
    out, err = job.out, job.err
    assert job.returncode != 0, (out, err)  # its daemon was killed
    _wait_for(lambda: not victim.exists(), f"{victim} to be removed")


class _Job:
    def __init__(self, pid):
        self.pid = pid


def test_mpirun_killed_before_any_rank_leaves_a_removable_dir_unless_pmix_refused_it(tmp_path):
    """dtrun locks mpirun's ompi.PID once a rank has started; an mpirun killed before that
    gets a free lock file at the end where the directory is provably its own (its rendezvous
    file written after the job began, PMIx did not refuse), so the next sweep removes it."""
    from types import SimpleNamespace

    env = {"TMPDIR": str(tmp_path)}
    lock = sessiondirs.LauncherLock(env)
    pid = dead_pid()
    lock.on_start(_Job(pid))
    ours = make_stale(tmp_path, "ompi", pid, lock=False)  # written now: after the job began
    lock.on_end(SimpleNamespace(pmix_refused=None))
    assert os.path.isfile(os.path.join(ours, SESSION_LOCK))
    refused_pid = dead_pid()
    theirs = make_stale(tmp_path, "ompi", refused_pid, lock=False)  # there before the job: PMIx refused it
    lock = sessiondirs.LauncherLock(env)
    lock.on_start(_Job(refused_pid))
    lock.on_end(SimpleNamespace(pmix_refused="this machine"))
    older_pid = dead_pid()
    older = make_stale(tmp_path, "ompi", older_pid, lock=False)
    for f in os.listdir(older):  # written an hour before the job began
        os.utime(os.path.join(older, f), (time.time() - 3600,) * 2)
    lock = sessiondirs.LauncherLock(env)  # began after ``older`` was written
    lock.on_start(_Job(older_pid))
    lock.on_end(SimpleNamespace(pmix_refused=None))
    assert sessiondirs.sweep(env) == [ours]
    assert os.path.isdir(theirs) and os.path.isdir(older)
    for kept in (theirs, older):
        assert not os.path.lexists(os.path.join(kept, SESSION_LOCK)), kept
