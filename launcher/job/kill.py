"""Ending a job's processes, in one module: the launcher's session on this host, and the
request to every host's agent (launcher/remote/agent.py ``kill``/``tidy``) to end what a
stopped job left there.

Only processes proven to be the job's are touched: this host's session is the one dtrun
started mpirun in; on the other hosts the agent kills only ranks the job directory lists
and the daemons that started them (it checks each against /proc itself).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Iterable, Optional, Sequence

from dtrun.launcher.remote.procfs import stat_fields
from dtrun.launcher.job.agents import agent_argv


def send_signal(proc, signum: int) -> None:
    """Signal the launcher process, if it is still there."""
    try:
        proc.send_signal(signum)
    except (ProcessLookupError, PermissionError):
        pass


def session_members(sid: int) -> list[int]:
    """Processes of session ``sid`` on this host (mpirun and everything it started, ssh clients too)."""
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    me = os.getpid()
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        fields = stat_fields(name)  # state, parent, process group, session, ...
        if fields is not None and len(fields) > 3 and int(fields[3]) == sid:
            found.append(int(name))
    return found


def kill_session(sid: int) -> None:
    """SIGKILL the process group and every remaining process of session ``sid``."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in session_members(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def pmix_namespace(launcher_pid: int) -> str:
    """The PMIx namespace Open MPI 5 gives a job: named after this host and mpirun's pid. The
    kill agent proves by it a daemon of the job whose ranks have ended (agent.kill, agent.reap)."""
    return f"prterun-{socket.gethostname()}-{launcher_pid}@0"


def kill_leftovers(job, hosts: Sequence[str], nspace: str = "", budget: float = 5.0) -> None:
    """On ``hosts`` at once, have the agent SIGKILL any rank of ``job`` (a jobstate.JobInfo)
    its directory still lists and the MPI daemons that started them (``nspace``: Open MPI 5's
    PMIx namespace, which proves a daemon whose ranks have ended is this job's).

    Bounded by ``budget`` seconds in all, whatever the network does (a silent host's ssh
    client is killed when it runs out).
    """
    hosts = list(dict.fromkeys(hosts))
    if hosts:
        run_host_agents(job, "kill", hosts, budget, (nspace,) if nspace else ())


def reap_remote_daemons(job, hosts: Sequence[str], nspace: str, budget: float = 3.0) -> None:
    """After an Open MPI 5 job ended by itself: on every other host at once, have the agent
    SIGKILL what is left of it. PMIx 5 can deadlock a prted in its own finalize after mpirun
    has gone (both of its threads waiting on each other: seen about once in 50 jobs with a
    failing rank on a loaded machine); nothing else would ever end it. The agent finds such a
    daemon by ``nspace`` (this job's, and mpirun has ended: no other job's) and the user's uid,
    and gives it a second to exit by itself (one still finalizing normally is not stuck).
    ``hosts``: the job's hosts other than this one."""
    hosts = list(dict.fromkeys(hosts))
    if not (hosts and nspace):
        return
    for host, answer in zip(hosts, run_host_agents(job, "reap", hosts, budget, (nspace,))):
        daemons = answer.get("daemons") if answer else None
        if isinstance(daemons, list) and daemons and all(type(d) is int for d in daemons):
            print(f"dtrun: {host}: the job's MPI daemon was still running after the job ended (pid "
                  f"{', '.join(map(str, daemons[:4]))}: Open MPI 5's prted can deadlock in PMIx's finalize); "
                  "dtrun ended it", file=sys.stderr)


def tidy_remote_hosts(job, hosts: Sequence[str], budget: float = 3.0) -> None:
    """On ``hosts`` (the job's other hosts) at once, remove what the job's ended ranks left in
    the job directory there (the agent's ``tidy``); dtrun removes its own host's directory."""
    hosts = list(dict.fromkeys(hosts))
    if hosts:
        run_host_agents(job, "tidy", hosts, budget)


def run_host_agents(job, mode: str, hosts: Iterable[str], budget: float,
                    extra: Sequence[str] = ()) -> list[Optional[dict]]:
    """Run the agent's ``mode`` on ``hosts`` in parallel and wait at most ``budget`` seconds.
    Returns each host's answer (the agent's last output line, a JSON object), in order; None
    where it gave none in time (the shell's profile on that host may print too: only the
    last line counts, and only as data)."""

    deadline = time.monotonic() + budget
    procs: list[Optional[subprocess.Popen]] = []
    for host in hosts:
        try:
            procs.append(subprocess.Popen(agent_argv(job, host, mode, budget, extra), stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                          start_new_session=True))
        except OSError:
            procs.append(None)
    answers: list[Optional[dict]] = []
    for p in procs:
        out = b""
        if p is not None:
            try:
                out, _ = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                out = b""
        answers.append(_answer(out))
    return answers


def _answer(out: bytes) -> Optional[dict]:
    lines = out[-65536:].decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None
