"""Ending a job's processes, in one module: the launcher's session on this host, and the
request to every host's agent (launcher/remote/agent.py ``kill``/``tidy``) to end what a
stopped job left there.

Only processes proven to be the job's are touched: this host's session is the one dtrun
started mpirun in; on the other hosts the agent kills only ranks the job directory lists
and the daemons that started them (it checks each against /proc itself).

Each round of agents (``AgentRound``) is bounded by its budget whatever the network does, and
may be waited for host by host: the restart loop waits only for the hosts its next attempt
uses, and the reap after a job that ended by itself runs on while dtrun goes on. Every round
still in flight is waited for before dtrun exits (``wait_agents``; its threads are not daemons,
so the interpreter waits for them too), and what it started is killed at its deadline.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
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
    start_kill(job, hosts, nspace, budget).wait()


def start_kill(job, hosts: Sequence[str], nspace: str = "", budget: float = 5.0) -> "AgentRound":
    """``kill_leftovers`` started, not waited for: the caller waits for the hosts it needs
    (``AgentRound.wait``); the others end within ``budget`` seconds, and before dtrun exits."""
    # The reap that ended the job (HangWatch) already kills what this would on the hosts it
    # answers from: one agent per host, not two, on hosts a failed job has just loaded.
    after = _reap_of(job, nspace) if nspace else None
    return AgentRound(job, "kill", hosts, budget, (nspace,) if nspace else (), after=after)


def reap_remote_daemons(job, hosts: Sequence[str], nspace: str, budget: float = 3.0) -> None:
    """After an Open MPI 5 job ended by itself: on every other host at once, have the agent
    SIGKILL what is left of it. PMIx 5 can deadlock a prted in its own finalize after mpirun
    has gone (both of its threads waiting on each other: seen about once in 50 jobs with a
    failing rank on a loaded machine); nothing else would ever end it. The agent finds such a
    daemon by ``nspace`` (this job's, and mpirun has ended: no other job's) and the user's uid,
    and gives it a second to exit by itself (one still finalizing normally is not stuck).
    ``hosts``: the job's hosts other than this one.

    Started, not waited for: a host that crashed (the usual reason a job ends by itself with
    a failure) would hold the end of the job for the whole budget, and a restart after it.
    It is waited for before dtrun exits (``wait_agents``); what it found is said then at the
    latest. It touches only the ended job's processes, so a next attempt may start meanwhile."""
    hosts = list(dict.fromkeys(hosts))
    if not (hosts and nspace):
        return
    AgentRound(job, "reap", hosts, budget, (nspace,), on_answer=_say_reaped)


def _say_reaped(host: str, answer: Optional[dict]) -> None:
    daemons = answer.get("daemons") if answer else None
    if isinstance(daemons, list) and daemons and all(type(d) is int for d in daemons):
        print(f"dtrun: {host}: the job's MPI daemon was still running after the job ended (pid "
              f"{', '.join(map(str, daemons[:4]))}: Open MPI 5's prted can deadlock in PMIx's finalize); "
              "dtrun ended it", file=sys.stderr, flush=True)


def tidy_remote_hosts(job, hosts: Sequence[str], budget: float = 3.0) -> None:
    """On ``hosts`` (the job's other hosts) at once, remove what the job's ended ranks left in
    the job directory there (the agent's ``tidy``); dtrun removes its own host's directory.
    Started, not waited for, as the reap (``wait_agents`` before dtrun exits)."""
    hosts = list(dict.fromkeys(hosts))
    if hosts:
        AgentRound(job, "tidy", hosts, budget)


def run_host_agents(job, mode: str, hosts: Iterable[str], budget: float,
                    extra: Sequence[str] = ()) -> list[Optional[dict]]:
    """Run the agent's ``mode`` on ``hosts`` in parallel and wait at most ``budget`` seconds.
    Returns each host's answer (the agent's last output line, a JSON object), in order; None
    where it gave none in time (the shell's profile on that host may print too: only the
    last line counts, and only as data)."""
    hosts = list(hosts)
    answers = AgentRound(job, mode, hosts, budget, extra).wait()
    return [answers.get(h) for h in hosts]


# Seconds past its deadline a round's reader waits for a killed agent's pipe to close.
_PIPE_GRACE_S = 1.0
_rounds: list["AgentRound"] = []  # rounds started and not yet waited for in full
_rounds_lock = threading.Lock()


class AgentRound:
    """The agent's ``mode`` on every host of ``hosts`` at once, each answer collected as it
    comes by a thread of its own. A host's agent that has not answered ``budget`` seconds
    after the start is killed, with its whole session (a ProxyCommand too); its answer is None.
    ``on_answer(host, answer)`` is called with each answer, None included.

    ``after``: an earlier round whose answer on a host stands for this one's (a ``reap`` of
    the same job kills what a ``kill`` would): such a host gets an agent of this round only
    where the earlier one gave no answer, with what is left of the budget."""

    def __init__(self, job, mode: str, hosts: Iterable[str], budget: float, extra: Sequence[str] = (),
                 on_answer=None, after: Optional["AgentRound"] = None):
        self.job, self.mode, self.extra = job, mode, tuple(extra)
        self.hosts = list(dict.fromkeys(hosts))
        self.deadline = time.monotonic() + budget
        self._answers: dict[str, Optional[dict]] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._on_answer = on_answer
        with _rounds_lock:
            _rounds.append(self)
        for host in self.hosts:
            # Not a daemon thread: the interpreter waits for it at exit, and it ends by the deadline.
            t = threading.Thread(target=self._run, args=(host, after), name=f"dtrun-agent-{mode}-{host}")
            self._threads[host] = t
            t.start()

    def _run(self, host: str, after: Optional["AgentRound"]) -> None:
        if after is not None and host in after.hosts:
            answer = after.wait([host])[host]  # bounded by that round's deadline
            if answer is not None or time.monotonic() >= self.deadline:
                self._answered(host, answer)
                return
        left = self.deadline - time.monotonic()
        try:
            p = subprocess.Popen(agent_argv(self.job, host, self.mode, left, self.extra), stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            self._answered(host, None)
            return
        try:
            out, _ = p.communicate(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(p)
            try:
                p.communicate(timeout=_PIPE_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            out = b""
        self._answered(host, _answer(out))

    def _answered(self, host: str, answer: Optional[dict]) -> None:
        self._answers[host] = answer
        if self._on_answer is not None:
            try:
                self._on_answer(host, answer)
            except Exception:  # a report's failure must not lose the other hosts' answers
                pass

    def answered_within(self, hosts: Iterable[str], seconds: float) -> dict[str, dict]:
        """The answers that ``hosts`` give within ``seconds`` from now (those that gave none
        by then are left out; their agents go on)."""
        deadline = time.monotonic() + seconds
        found = {}
        for h in dict.fromkeys(hosts):
            t = self._threads.get(h)
            if t is None:
                continue
            t.join(max(0.0, deadline - time.monotonic()))
            answer = self._answers.get(h) if not t.is_alive() else None
            if answer is not None:
                found[h] = answer
        return found

    def wait(self, hosts: Optional[Iterable[str]] = None) -> dict[str, Optional[dict]]:
        """The answers of ``hosts`` (default: all), once each has answered or run out of time."""
        hosts = self.hosts if hosts is None else [h for h in dict.fromkeys(hosts) if h in self.hosts]
        for h in hosts:
            self._threads[h].join()
        if all(not t.is_alive() for t in self._threads.values()):
            with _rounds_lock:
                if self in _rounds:
                    _rounds.remove(self)
        return {h: self._answers.get(h) for h in hosts}


def _reap_of(job, nspace: str) -> Optional[AgentRound]:
    """The reap of ``job`` still in flight or not yet waited for, if any."""
    with _rounds_lock:
        return next((r for r in reversed(_rounds)
                     if r.mode == "reap" and r.job.dir == job.dir and r.extra == (nspace,)), None)


def wait_agents() -> None:
    """Wait for every round of agents still in flight (each ends by its own deadline)."""
    with _rounds_lock:
        rounds = list(_rounds)
    for r in rounds:
        r.wait()


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL an agent's ssh client and whatever it started (it leads its own session)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _answer(out: bytes) -> Optional[dict]:
    lines = out[-65536:].decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None
