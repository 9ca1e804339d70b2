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

These are the rules, pure and tested by value (``plan_hosts``, ``failure_of``,
``repeated_failure``, ``attempt_line``, ``lost_host_lines``), and the options they take;
the loop that applies them after each attempt is launcher/run.py's.
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
# (opts, selection, hosts, environ) -> {host name: why it failed}; hosts not named passed.
HostCheck = Callable[..., Mapping[str, str]]
# A Python traceback's innermost frame and its exception line, as a rank's stderr shows
# them (after an optional launcher tag such as "[host,1]<stderr>: " or "1: ").
_TAG = r"(?:\[[^\]\n]*\](?:<std(?:err|out)>)?:? ?|\d+: )?"
_FRAME_RE = re.compile(r"^" + _TAG + r'\s*File "([^"]+)", line (\d+), in (\S+)')
_EXC_RE = re.compile(r"^" + _TAG + r"([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)|AssertionError)(?::|$)")


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


def repeated_failure(earlier: Mapping[tuple, int], current: Failure, hosts_healthy: bool) -> Optional[int]:
    """The no-blind-loop rule: a failure that already ended an earlier attempt of this run
    while every host passed the check, and does so again: the program's own (alternating
    failures A, B, A stop at the second A). Returns that earlier attempt (0-based), or None.
    ``earlier`` maps the key of each failure on healthy hosts to its first attempt."""
    return earlier.get(current.key) if hosts_healthy else None


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
