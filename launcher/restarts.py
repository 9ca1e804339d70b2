"""Restarting a failed job without the hosts that failed (``--max-restarts``, ``--spares``, ``--min-np``).

When an attempt fails, dtrun checks every host the job could use (the injected host
check: ssh reachable under mpirun, a one-node step under Slurm; all at once, bounded by
a timeout), stops what is left of the attempt on the hosts that pass, leaves out those
that fail, and starts the whole job again on the hosts that remain plus spares: slots
the first attempt did not use (hosts beyond ``-np``, or ``--spares``). Each attempt gets
one line saying what failed, which hosts were left out and why, and where it runs.

What is never restarted: a job stopped by the user (a signal, ``scancel``), a job that
ran past ``--timeout`` (the run's limit, shared by its attempts), and a failure that is the
program's own: a failure that already ended an earlier attempt while every host passed the
check both times (``repeated_failure``: A, B, A stops at the second A).

The check is quick where the run can go on without a host (``lost_hosts``,
``going_on_without``): a host that the failure's own evidence names as lost (its MPI daemon
was lost, all its ranks went silent, or it closed the ssh connection of its MPI daemon) is
left out at once, not waited on for the check's timeout; the other hosts get the check's
short bound (a healthy host answers within milliseconds), and one that does not answer in it
is left out too. Only a host the next attempt cannot do without gets the full timeout.

These are the rules, pure and tested by value (``plan_hosts``, ``failure_of``,
``repeated_failure``, ``attempt_line``, ``lost_host_lines``, ``lost_hosts``,
``going_on_without``), and the options they take; the loop that applies them after each
attempt is launcher/run.py's.
"""
from __future__ import annotations

import collections
import re
import signal
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from dtrun.launcher.errors import UsageError, signal_name
from dtrun.launcher.hostfile import HostSlots, parse_host_list
from dtrun.launcher.job.result import JobResult, root_cause
from dtrun.launcher.job.summary import launcher_ended
from dtrun.launcher.safe import MAX_RANKS, count

# The host check the CLI injects (launcher/ never imports checks/):
# (opts, selection, hosts, environ, quick=False) -> {host name: why it failed}; hosts not
# named passed. ``quick=True``: the check's short bound, for a run that can go on without a
# host that does not answer in it.
HostCheck = Callable[..., Mapping[str, str]]
# A Python traceback's innermost frame and its exception line, as a rank's stderr shows
# them (after an optional launcher tag such as "[host,1]<stderr>: " or "1: ").
_TAG = r"(?:\[[^\]\n]*\](?:<std(?:err|out)>)?:? ?|\d+: )?"
_FRAME_RE = re.compile(r"^" + _TAG + r'\s*File "([^"]+)", line (\d+), in (\S+)')
_EXC_RE = re.compile(r"^" + _TAG + r"([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)|AssertionError)(?::|$)")
# OpenSSH's client when the server's end of its connection closed without the protocol's own
# close: sshd was killed with the host's processes, or the host went down (its kernel still
# closing the socket). mpirun's ssh clients carry the MPI daemons; the name is after HostName.
_CLOSED_RE = re.compile(r"^" + _TAG + r"Connection to (\S+?) closed by remote host\.?\s*$")


class NotEnoughSlots(Exception):
    """The hosts left cannot hold ``-np`` ranks (or ``--min-np``)."""


@dataclass(frozen=True)
class HostPlan:
    """Where one attempt runs."""

    hosts: tuple[HostSlots, ...]  # the hosts handed to the launcher, each of them holds ranks
    np: int
    spares: tuple[str, ...] = ()  # hosts among them that held no rank in the first attempt
    rank_hosts: tuple[str, ...] = ()  # host of each rank (slots filled in order)


def fill(hosts: Sequence[HostSlots], np: int, oversubscribe: bool = False) -> tuple[list[HostSlots], list[str]]:
    """The first hosts whose slots hold ``np`` ranks, and each rank's host (slots filled in
    order, as ``--map-by slot`` and Hydra's ``-hosts`` do; round robin when oversubscribed)."""
    order = [h.host for h in hosts for _ in range(max(int(h.slots), 1))]
    if not order:
        return [], []
    ranks = [order[r % len(order)] for r in range(np)]
    used = set(ranks)
    return [h for h in hosts if h.host in used], ranks


def plan_hosts(primary: Sequence[HostSlots], spares: Sequence[HostSlots], left_out: Sequence[str], np: int,
               min_np: Optional[int] = None, oversubscribe: bool = False,
               first: Sequence[str] = ()) -> HostPlan:
    """The hosts and rank count of an attempt: the user's hosts, then ``--spares``, less
    those left out. ``-np`` stays while the slots last; with ``min_np`` the job may go on
    with fewer ranks, down to it.

    Args:
        first: hosts that held ranks in the first attempt (others are called spares).

    Raises:
        NotEnoughSlots: fewer slots than ``np`` (and than ``min_np``), or no host at all.
    """
    out = set(left_out)
    candidates = [h for h in list(primary) + list(spares) if h.host not in out]
    total = sum(max(int(h.slots), 1) for h in candidates)
    gone = ", ".join(h for h in dict.fromkeys(left_out)) or "none"
    if not candidates:
        raise NotEnoughSlots(f"no host is left (left out: {gone})")
    if total >= np or oversubscribe:
        n = np
    elif min_np is not None and total >= min_np:
        n = total
    else:
        need = f"-np {np}" + (f" or --min-np {min_np}" if min_np is not None else "")
        raise NotEnoughSlots(f"{total} slot{'s' if total != 1 else ''} left on {', '.join(h.host for h in candidates)} "
                             f"(left out: {gone}), fewer than {need}")
    hosts, ranks = fill(candidates, n, oversubscribe)
    spare = tuple(h.host for h in hosts if first and h.host not in first)
    return HostPlan(tuple(hosts), n, spare, tuple(ranks))


@dataclass(frozen=True)
class Failure:
    """What ended one attempt, in a phrase, and the key that tells two failures apart."""

    what: str
    key: tuple
    hosts: tuple[str, ...] = ()  # hosts the failure names
    restartable: bool = True
    reason: str = ""  # why not restartable


class ErrorWatch:
    """A job observer (launcher.job.observer.JobObserver) that keeps the last Python exception a rank
    printed: its type and innermost frame tell one program bug from another."""

    def __init__(self, lines: int = 400):
        self.tail: collections.deque = collections.deque(maxlen=lines)

    def on_start(self, job) -> None:
        pass

    def on_output(self, stream, data) -> None:
        if stream == "stderr":
            self.tail.append(data.decode("utf-8", "replace").rstrip("\n"))

    def on_rank_start(self, rank, host) -> None:
        pass

    def on_rank_exit(self, failure) -> None:
        pass

    def on_signal(self, signum) -> bool:
        return False

    def on_end(self, result) -> None:
        pass

    def exception(self) -> Optional[tuple[str, str]]:
        return last_exception(list(self.tail))

    def closed(self) -> tuple[str, ...]:
        """The addresses whose ssh connection the far end closed (``closed_connections``)."""
        return closed_connections(list(self.tail))


def last_exception(lines: Sequence[str]) -> Optional[tuple[str, str]]:
    """("file:line", "ExceptionType") of the last Python traceback in ``lines``, if any."""
    frame, found = None, None
    for line in lines:
        m = _FRAME_RE.match(line)
        if m:
            frame = f"{m.group(1)}:{m.group(2)}"
            continue
        e = _EXC_RE.match(line)
        if e and frame is not None:
            found, frame = (frame, e.group(1)), None
    return found


def failure_of(result: JobResult, exception: Optional[tuple[str, str]] = None, on_hang: str = "report",
               timed_out: bool = False) -> Failure:
    """The failure of one attempt from its ``JobResult`` (and the last exception a rank
    printed), and whether a restart may help."""
    if result.interrupted:
        return Failure(f"stopped by {signal_name(result.signum or signal.SIGINT)}", ("signal",), (), False,
                       "a job stopped by a signal is never restarted")
    if result.stdout_closed:
        return Failure("stdout was closed", ("stdout",), (), False, "dtrun's output went away")
    if result.hung:
        what = "no progress (--hang-timeout)"
        if on_hang != "restart":
            return Failure(what, ("hang",), (), False, "--on-hang abort")
        return Failure(what, ("hang",))
    if result.timeout and timed_out:
        return Failure(result.timeout, ("timeout",), (), False, "--timeout covers the whole run")
    cause = root_cause(result.failures)
    if cause is not None:
        what = f"rank {cause.rank} on {cause.host} {cause.how}"
        if exception is not None:
            what += f" ({exception[1]} at {exception[0]})"
            key = ("exception",) + exception + (cause.code, cause.signum)
        elif cause.signum is not None:  # a kill (the OOM killer, a signal from outside): per rank
            key = ("signal", cause.rank, cause.signum)
        else:  # the program's own exit code, whichever rank got there first
            key = ("code", cause.code, cause.start_error)
        return Failure(what, key, (cause.host,))
    if result.lost_daemon_host:
        return Failure(f"the MPI daemon on {result.lost_daemon_host} was lost", ("daemon", result.lost_daemon_host),
                       (result.lost_daemon_host,))
    if result.vanished:
        hosts = tuple(dict.fromkeys(h for _, h in result.vanished))
        ranks = ",".join(r for r, _ in result.vanished)
        return Failure(f"rank{'s' if len(result.vanished) > 1 else ''} {ranks} on {', '.join(hosts)} went silent",
                       ("silent",) + hosts, hosts)
    if result.timeout:
        return Failure(result.timeout, ("start-timeout",))
    return Failure(launcher_ended(result), ("mpirun", result.mpirun_returncode))


def closed_connections(lines: Sequence[str]) -> tuple[str, ...]:
    """The addresses (ssh's HostName, or the host name) of every "Connection to X closed by
    remote host." line in ``lines``, in order, once each."""
    found = (_CLOSED_RE.match(line) for line in lines)
    return tuple(dict.fromkeys(m.group(1) for m in found if m))


def ssh_hostname(config_dump: str) -> Optional[str]:
    """The HostName of ``ssh -G HOST``'s output (its "hostname X" line), or None."""
    for line in config_dump.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip():
            return value.strip()
    return None


def lost_hosts(result: JobResult, rank_hosts: Sequence[str], closed: Sequence[str] = ()) -> dict[str, str]:
    """The hosts the failure's own evidence names as lost, each with why: the one whose MPI
    daemon Open MPI lost, those whose every rank went silent (``result.vanished``, the ranks
    that started and were never heard of again), and ``closed``: those whose MPI daemon's ssh
    connection the host closed (``closed_connections``, mapped to host names by the caller).
    A host where some rank was still heard from is not named by silence."""
    found: dict[str, str] = {}
    if result.lost_daemon_host:
        found[result.lost_daemon_host] = "its MPI daemon was lost"
    silent = {r for r, _ in result.vanished}
    for host in dict.fromkeys(h for _, h in result.vanished):
        ranks = [str(r) for r in _ranks_on(rank_hosts, host)]
        if ranks and all(r in silent for r in ranks):
            found.setdefault(host, f"{'its rank' if len(ranks) == 1 else 'all its ranks'} went silent")
    for host in closed:
        found.setdefault(host, "it closed its MPI daemon's ssh connection")
    return found


def slots_left(primary: Sequence[HostSlots], spares: Sequence[HostSlots], left_out: Sequence[str], np: int,
               min_np: Optional[int] = None, oversubscribe: bool = False) -> Callable[[Sequence[str]], bool]:
    """Whether a next attempt fits (``plan_hosts``) with the hosts it is given left out, beside ``left_out``."""
    def fits(more: Sequence[str]) -> bool:
        try:
            plan_hosts(primary, spares, list(left_out) + list(more), np, min_np, oversubscribe)
        except NotEnoughSlots:
            return False
        return True
    return fits


def going_on_without(hosts: Sequence[str], fits: Callable[[Sequence[str]], bool],
                     already: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(the hosts the run may leave out, those it cannot do without), in order: each host in
    turn is left out when the next attempt still fits (``fits``) without it, ``already`` and
    the hosts left out before it."""
    out: list[str] = []
    needed: list[str] = []
    for host in dict.fromkeys(hosts):
        (out if fits(list(already) + out + [host]) else needed).append(host)
    return out, needed


def repeated_failure(earlier: Mapping[tuple, int], current: Failure, hosts_healthy: bool) -> Optional[int]:
    """The no-blind-loop rule: a failure that already ended an earlier attempt of this run
    while every host passed the check, and does so again: the program's own (alternating
    failures A, B, A stop at the second A). Returns that earlier attempt (0-based), or None.
    ``earlier`` maps the key of each failure on healthy hosts to its first attempt."""
    if not hosts_healthy:
        return None
    return next((n for key, n in earlier.items() if same_failure(key, current.key)), None)


def same_failure(a: tuple, b: tuple) -> bool:
    """Whether two failure keys name the same failure. An exit with a traceback and the same
    exit code without one are the same: the launcher can lose the output of a rank that
    aborts the job (Open MPI 5 drops it at times), and that must not make a bug look new."""
    if a == b:
        return True
    ex, plain = (a, b) if a[:1] == ("exception",) else (b, a)
    return (ex[:1] == ("exception",) and plain[:1] == ("code",) and ex[4] is None and ex[3] == plain[1]
            and not plain[2])


def _ranks_on(rank_hosts: Sequence[str], host: str) -> list[int]:
    return [r for r, h in enumerate(rank_hosts) if h == host]


def _ranks_text(ranks: Sequence[int]) -> str:
    if not ranks:
        return "no rank"
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def lost_host_lines(bad: Mapping[str, str], rank_hosts: Sequence[str]) -> list[str]:
    """One line per host that failed the check after the job failed: which host, what the
    check found, and which ranks were on it."""
    lines = []
    for host, why in bad.items():
        ranks = _ranks_on(rank_hosts, host)
        on = f"{_ranks_text(ranks)} {'was' if len(ranks) == 1 else 'were'} on it" if ranks else "it held no rank"
        lines.append(f"dtrun: host {host} was lost: {why}; {on}")
    return lines


def attempt_line(n: int, total: int, failure: Failure, left_out: Mapping[str, str], plan: HostPlan) -> str:
    """The block that opens attempt ``n`` (1-based) of ``total``: what failed, the hosts left
    out and why, and where this attempt runs."""
    if left_out:
        parts = [f"{h} left out ({why})" for h, why in left_out.items()]
        head = ", ".join(parts) + f"; {failure.what}"
    else:
        head = f"{failure.what}; every host passed the check"
    where = ", ".join(f"{h.host} (spare)" if h.host in plan.spares else h.host for h in plan.hosts)
    return f"dtrun: attempt {n} of {total}: {head}; {plan.np} rank{'s' if plan.np != 1 else ''} on {where}"


def parse_spares(text: Optional[str]) -> tuple[HostSlots, ...]:
    if not text:
        return ()
    return tuple(parse_host_list(text, "--spares"))


def check_options(opts, selection) -> tuple[tuple[HostSlots, ...], Optional[int]]:
    """Validate --max-restarts, --spares and --min-np; return the spare hosts and min-np."""
    if opts.max_restarts < 0:
        raise UsageError(f"--max-restarts {opts.max_restarts}: give 0 or more")
    if not opts.max_restarts and (opts.spares or opts.min_np is not None):
        flag = "--spares" if opts.spares else "--min-np"
        raise UsageError(f"{flag} is used when a job restarts: add --max-restarts N")
    if opts.on_hang == "restart" and (opts.hang_timeout is None or not opts.max_restarts):
        need = " and ".join(f for f, v in (("--hang-timeout S", opts.hang_timeout), ("--max-restarts N",
                                                                                   opts.max_restarts)) if not v)
        raise UsageError(f"--on-hang restart restarts a job that made no progress for --hang-timeout seconds: "
                         f"add {need}")
    if selection is None:
        return (), None
    spares = parse_spares(opts.spares)
    names = set(selection.names)
    twice = [h.host for h in spares if h.host in names]
    if twice:
        raise UsageError(f"--spares: {', '.join(twice)} already in the job's hosts ({selection.source})")
    min_np = None
    if opts.min_np is not None:
        min_np = count(str(opts.min_np), "--min-np", MAX_RANKS)
        if min_np <= 0:
            raise UsageError(f"--min-np {min_np}: give a positive number of ranks")
    return spares, min_np
