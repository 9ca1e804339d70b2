"""No process of a failed attempt survives on any host once the next attempt runs (Open MPI 5).

Between attempts dtrun has each healthy host's kill agent stop what is left of the failed
attempt (launcher/run.py ``_cleanup``). A daemon (``prted``) whose ranks have already
ended has no rank left to prove it the job's: only the attempt's PMIx namespace does
(launcher/remote/rankstate.py ``started_by``), so the clean-up must hand it to the agent.

The agent considers only the daemons recorded in the job directory, so the scenario keeps
that record: the rank on the frozen daemon's host is SIGKILLed (a rank that exits on its
own has its wrapper remove its host's daemon record, rankstate ``_after_last_rank``), and
dtrun itself stops the attempt (the host is lost silently and the hang watchdog fires;
when mpirun ends by itself the hang watch's ``tidy`` removes the record first, hangwatch
``HangWatch.on_end``). Either way the daemon would be out of reach of any proof.
"""
import os
import signal
import subprocess
import threading
import time

import psutil
import pytest

from tests import nscluster
from tests.dtrun_helpers import DTRUN, REPO, module_cluster, user_env, wait_until_empty
from tests.test_restarts_cluster import lose, revive

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]


@pytest.fixture(scope="module")
def cluster4():
    yield from module_cluster(4, terminate_strays=True)


def _alive(pid, start):
    """Whether ``pid`` is still the process that started at ``start``, and not a zombie."""
    try:
        p = psutil.Process(pid)
        return p.create_time() == start and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _procs_on(host, match):
    """(pid, start time, command line) of the live processes of ``host``'s namespace whose
    command line and environment (a list of bytes) satisfy ``match(cmd, env)``."""
    found = []
    for pid in nscluster._netns_pids(host.netns):
        try:
            p = psutil.Process(pid)
            cmd, start = " ".join(p.cmdline()), p.create_time()
        except psutil.Error:
            continue
        if _alive(pid, start) and match(cmd, _environ(pid)):
            found.append((pid, start, cmd))
    return found


def _nspace(cmd):
    words = cmd.split()
    return next((words[i + 1].strip('"') for i, w in enumerate(words[:-1]) if w == "ess_base_nspace"), "")


def _wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


def test_frozen_daemon_of_a_failed_attempt_is_gone_when_the_next_attempt_runs(cluster4, tmp_path):
    """Attempt 1 on h1-h3: h2's rank is killed while its prted is frozen (SIGSTOP), then h3 is
    lost (silent: the hang watchdog stops the attempt). dtrun restarts on h1, h2 and the spare
    h4; by the time those ranks are up, the clean-up has killed the frozen prted, and nothing
    of attempt 1 is alive on any host."""
    a, b, c, d = cluster4.hosts
    token = f"dtrun-rcleanup-{os.getpid()}-{time.monotonic_ns()}"
    prog = tmp_path / f"{token}.py"
    ticking = tmp_path / "ticking"  # attempt 1's ranks show progress while it exists
    ticking.touch()
    prog.write_text("import os, time\nn = os.environ['DTRUN_RESTART_COUNT']\nprint('up', n, flush=True)\n"
                    f"while n != '0' or os.path.exists({str(ticking)!r}):\n"
                    "    print('tick', flush=True)\n    time.sleep(0.5)\ntime.sleep(300)\n")
    config = str(cluster4.ssh_config)
    argv = [DTRUN, "--ssh-config", config, "--no-tag-output", "-H", f"{a.name}:1,{b.name}:1,{c.name}:1",
            "--spares", f"{d.name}:1", "--max-restarts", "1", "--hang-timeout", "4", "--on-hang", "restart",
            "python", str(prog)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=user_env(),
                            cwd=REPO, stdin=subprocess.DEVNULL)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    seen: list[str] = []

    def ups(n, attempt):
        """Read dtrun's output until ``n`` ranks of ``attempt`` (DTRUN_RESTART_COUNT) said 'up'."""
        deadline = time.monotonic() + 90
        while seen.count(f"up {attempt}") < n and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line.strip())
        assert seen.count(f"up {attempt}") == n, (seen, "".join(err))

    def of_attempt_1(cmd, env):
        return (nspace and nspace in cmd) or b"DTRUN_RESTART_COUNT=0" in env

    frozen, lost, nspace = [], [], ""
    try:
        ups(3, 0)
        # h2's daemon: the prted that ssh started forks the one that starts the ranks
        prteds = [(p, s, cmd) for p, s, cmd in _procs_on(b, lambda cmd, env: config in cmd)
                  if cmd.split()[0].endswith("/prted")]
        pids = {p for p, _, _ in prteds}
        daemons = [(p, s, cmd) for p, s, cmd in prteds if psutil.Process(p).ppid() in pids]
        assert len(daemons) == 1, prteds
        pid, start, cmd = daemons[0]
        nspace = _nspace(cmd)
        assert nspace.startswith("prterun-"), cmd
        # attempt 1's processes on every host: its ranks (wrappers, programs, helpers) and daemons
        first = [(h.name, p, s) for h in cluster4.hosts for p, s, _ in _procs_on(h, of_attempt_1)]
        assert len([x for x in first if x[0] == a.name]) >= 3, first  # wrapper, program, daemons
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)
        # h2's rank ends (wrapper and program SIGKILLed); its frozen daemon cannot tell mpirun
        for p, _, _ in _procs_on(b, lambda cmd, env: token in cmd):
            os.kill(p, signal.SIGKILL)
        _wait_for(lambda: not _procs_on(b, lambda cmd, env: token in cmd), 30, f"the end of the rank on {b.name}")
        lost.append(c)
        lose(c, silent_first=True)
        ticking.unlink()  # no more progress: the watchdog stops attempt 1
        ups(3, 1)  # attempt 2 runs on h1, h2 and h4
        assert not _alive(pid, start), \
            f"the frozen prted {pid} of attempt 1 on {b.name} is alive while attempt 2 runs:\n" + "".join(err)
        left = wait_until_empty(lambda: [(h.name, p, cmd[:300]) for h in cluster4.hosts
                                         for p, _, cmd in _procs_on(h, of_attempt_1)]
                                + [x for x in first if _alive(x[1], x[2])], timeout=10)
        assert left == [], left
        assert f"3 ranks on {a.name}, {b.name}, {d.name} (spare)" in "".join(err), "".join(err)
    finally:
        for p in frozen:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            for h in lost:
                revive(cluster4, h)
