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

The pure parts (``plan_hosts``, ``failure_of``, ``repeated_failure``, ``attempt_line``,
``lost_host_lines``) are tested by value; ``run`` is the loop around the launch.
"""
from __future__ import annotations

import collections
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence

from dtrun.launcher.errors import ExitCode, UsageError
from dtrun.launcher.hostfile import HostSlots
from dtrun.launcher.job import stopsignals

# The host check the CLI injects (launcher/ never imports checks/):
# (opts, selection, hosts, environ) -> {host name: why it failed}; hosts not named passed.
HostCheck = Callable[..., Mapping[str, str]]
# Seconds every step of the host check may take (ssh connect and banner, or Slurm's step).
CHECK_TIMEOUT_S = 5.0
# Seconds the kill agents get to stop what is left of a failed attempt on the healthy hosts.
CLEANUP_BUDGET_S = 5.0
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


def failure_of(result, exception: Optional[tuple[str, str]] = None, on_hang: str = "report",
               timed_out: bool = False) -> Failure:
    """The failure of one attempt from its ``launcher.job.result.JobResult`` (and the last exception
    a rank printed), and whether a restart may help."""
    from dtrun.launcher.errors import signal_name
    from dtrun.launcher.job.result import root_cause

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
    from dtrun.launcher.job.summary import launcher_ended

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


# ---- the loop -----------------------------------------------------------------------------------

@dataclass
class Attempt:
    """What ``launch._attempt`` hands back: dtrun's exit code and what the loop needs."""

    code: int
    result: object = None  # launcher.job.result.JobResult (None for a dry run)
    rank_hosts: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    job: object = None  # launcher.jobstate.JobInfo, for the clean-up
    ended: bool = False  # Slurm ended the allocation or step (scancel): never restarted
    srun: bool = False
    in_slurm: bool = False
    elapsed: float = 0.0
    selection: object = None  # launcher.hosts.HostSelection of this attempt
    cleaned: bool = False  # the attempt already stopped its leftovers on every host
    nspace: str = ""  # Open MPI 5: the attempt's PMIx namespace, which proves its daemons (kill agent)


@dataclass
class Timings:
    """Seconds of each step between a fault and the next attempt (benchmarks/bench_restarts.py)."""

    detected: list = field(default_factory=list)  # monotonic time the attempt ended
    check: list = field(default_factory=list)
    cleanup: list = field(default_factory=list)
    relaunched: list = field(default_factory=list)  # monotonic time the next attempt started


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parse_spares(text: Optional[str]) -> tuple[HostSlots, ...]:
    if not text:
        return ()
    from dtrun.launcher.hostfile import parse_host_list

    return tuple(parse_host_list(text, "--spares"))


def check_options(opts, selection) -> tuple[tuple[HostSlots, ...], Optional[int]]:
    """Validate --max-restarts, --spares and --min-np; return the spare hosts and min-np."""
    from dtrun.launcher.safe import MAX_RANKS, count

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


def run(opts, attempt: Callable[..., Attempt], preflight=None, host_check: Optional[HostCheck] = None,
        environ: Optional[Mapping[str, str]] = None, timings: Optional[Timings] = None) -> int:
    """Run the job, and with ``--max-restarts N`` restart it up to N times without the hosts
    that fail the check. ``attempt(opts, job_dir, preflight, observers, cleanup)`` runs one
    attempt (``launch._attempt``). Returns dtrun's exit code."""
    environ = os.environ if environ is None else environ
    check_options(opts, None)
    loop = _Attempts(opts, attempt, preflight, host_check, environ, timings)
    if not loop.restarts:
        return loop.one()  # a stop signal outside the job ends dtrun in cli.main
    try:
        while True:
            code = loop.one()
            if code is not None:
                return code
    except stopsignals.Stopped as exc:
        from dtrun.launcher.errors import signal_name

        _say(f"dtrun: stopped by {signal_name(exc.signum)} between attempts; no further attempt")
        return stopsignals.exit_code(exc.signum)


class _Attempts:
    """The attempts of one run: the hosts planned, those left out and why, the failure of
    the earlier attempts (a failure seen again on good hosts is the program's own)."""

    def __init__(self, opts, attempt, preflight, host_check: Optional[HostCheck], environ, timings):
        from dtrun.launcher.hosts import resolve_hosts, resolve_np

        self.opts, self.attempt, self.preflight = opts, attempt, preflight
        self.host_check, self.environ, self.timings = host_check, environ, timings
        self.restarts = opts.max_restarts > 0
        self.selection = self.plan = None
        self.spares: tuple[HostSlots, ...] = ()
        self.min_np = self.np = None
        self.first: tuple[str, ...] = ()
        if self.restarts:
            self.selection = resolve_hosts(opts.hosts, environ)
            self.spares, self.min_np = check_options(opts, self.selection)
            self.np = resolve_np(opts.np, self.selection, opts.oversubscribe)
            if self.min_np is not None and self.min_np > self.np:
                raise UsageError(f"--min-np {self.min_np} is more than -np {self.np}")
            self.plan = plan_hosts(self.selection.hosts, (), (), self.np, None, opts.oversubscribe)
            self.first = tuple(h.host for h in self.plan.hosts)
        self.base_id = opts.run_id or (_new_run_id() if opts.log_dir else None)
        self.left_out: dict[str, str] = {}
        self.healthy_failures: dict[tuple, int] = {}  # failure key -> first attempt (0-based) it ended on good hosts
        self.total = opts.max_restarts + 1
        self.n = 0
        # --timeout is the run's: every attempt gets what is left of it (launch._time_left).
        self.deadline = time.monotonic() + opts.timeout if opts.timeout is not None and opts.timeout > 0 else None

    def _opts(self, job_dir):
        """The options of attempt ``n``: its hosts, rank count, restart count and run id."""
        opts, n = self.opts, self.n
        if not self.restarts:
            return replace(opts, job_dir=job_dir)
        return replace(opts, job_dir=job_dir, deadline=self.deadline, selection=replace(self.selection, hosts=self.plan.hosts),
                       np=str(self.plan.np),
                       env=tuple(opts.env) + (f"DTRUN_RESTART_COUNT={n}", f"TORCHELASTIC_RESTART_COUNT={n}"),
                       run_id=f"{self.base_id}-attempt-{n + 1}" if self.base_id else opts.run_id)

    def one(self) -> Optional[int]:
        """Run one attempt; dtrun's exit code when the run is over, None to go on."""
        from dtrun.launcher import jobstate

        job_dir = jobstate.new_dir()
        try:
            watch = ErrorWatch()
            a_opts = self._opts(job_dir)
            if self.timings is not None and self.n > 0:
                self.timings.relaunched.append(time.monotonic())
            att = self.attempt(a_opts, job_dir, self.preflight, (watch,), not self.restarts)
            if self.timings is not None:
                self.timings.detected.append(time.monotonic())
            if att.code == 0 or att.result is None:
                return att.code
            failure = failure_of(att.result, watch.exception(), self.opts.on_hang, _timed_out(att.result))
            if att.ended:
                failure = replace(failure, restartable=False, reason="Slurm stopped the job")
            try:
                bad = self._check_hosts(att, a_opts, failure)
            except stopsignals.Stopped:
                if self.restarts and not att.cleaned:
                    with stopsignals.held():
                        _cleanup(att, att.hosts)
                raise
            t0 = time.monotonic()
            if self.restarts and not att.cleaned:
                with stopsignals.held():  # a signal now waits for the clean-up, then ends the run
                    _cleanup(att, [h for h in att.hosts if h not in bad])
            if self.timings is not None:
                self.timings.cleanup.append(time.monotonic() - t0)
            return self._next(att, failure, bad)
        finally:
            jobstate.remove(job_dir)

    def _check_hosts(self, att: Attempt, a_opts, failure: Failure) -> dict[str, str]:
        """The hosts that fail the check after this failure (host -> why), each lost one said."""
        from dtrun.launcher.hosts import all_local

        used = att.selection if att.selection is not None else self.selection
        candidates = [h for h in used.hosts if h.host in att.hosts] if used is not None else []
        if self.restarts and failure.restartable:
            # spares too: one that cannot be reached must not be the next attempt's
            candidates = [h for h in list(self.selection.hosts) + list(self.spares) if h.host not in self.left_out]
        bad: dict[str, str] = {}
        t0 = time.monotonic()
        if self.host_check is not None and candidates and not all_local(candidates) \
                and (failure.restartable or not self.restarts) and not att.result.interrupted \
                and not att.result.stdout_closed and not att.ended:
            bad = dict(self.host_check(a_opts, used, candidates, self.environ))
        if self.timings is not None:
            self.timings.check.append(time.monotonic() - t0)
        for line in lost_host_lines({h: w for h, w in bad.items() if h in att.hosts}, att.rank_hosts):
            _say(line)
        return bad

    def _next(self, att: Attempt, failure: Failure, bad: dict[str, str]) -> Optional[int]:
        """After a failed attempt: the exit code when no attempt follows, else None (the plan
        of the next attempt made and said)."""
        if not self.restarts or not failure.restartable:
            return att.code
        earlier = repeated_failure(self.healthy_failures, failure, not bad)
        if earlier is not None:
            again = "twice in a row" if earlier == self.n - 1 else f"again (as in attempt {earlier + 1})"
            _say(f"dtrun: not restarting: the same failure {again} ({failure.what}) while every "
                 f"host passed the check: the program's own error; fix it and run again (exit code "
                 f"{att.code}, the job's own)")
            return att.code
        if not bad:
            self.healthy_failures.setdefault(failure.key, self.n)
        if self.n + 1 >= self.total:
            _say(f"dtrun: not restarting: all {self.total} attempts (--max-restarts {self.opts.max_restarts}) "
                 f"failed; the last: {failure.what} (exit code {int(ExitCode.RESTARTS)})")
            return ExitCode.RESTARTS
        if self.deadline is not None and time.monotonic() >= self.deadline:
            _say(f"dtrun: not restarting: the run used all of --timeout {self.opts.timeout:g} s (it counts "
                 f"across attempts); the last: {failure.what} (exit code {int(ExitCode.TIMEOUT)})")
            return ExitCode.TIMEOUT
        self.left_out.update(bad)
        try:
            self.plan = plan_hosts(self.selection.hosts, self.spares, list(self.left_out), self.np, self.min_np,
                                   self.opts.oversubscribe, self.first)
        except NotEnoughSlots as exc:
            _say(f"dtrun: not restarting: {exc}; {failure.what} (exit code {int(ExitCode.RESTARTS)}); "
                 f"add hosts with --spares, or let the job go on with fewer ranks with --min-np")
            return ExitCode.RESTARTS
        self.n += 1
        if att.srun and att.in_slurm:
            # The failed step keeps its CPUs until Slurm hears from the lost node (SlurmdTimeout):
            # the next step shares them (--overlap); the host check was the Slurm preflight.
            self.opts = replace(self.opts, preflight=False,
                                mpi_args=" ".join(filter(None, (self.opts.mpi_args, "--overlap"))))
        _say(attempt_line(self.n + 1, self.total, failure, dict(bad), self.plan))
        return None


def _new_run_id() -> str:
    from dtrun.launcher.paths import new_run_id

    return new_run_id()


def _timed_out(result) -> bool:
    """Whether the run's --timeout stopped the attempt (never restarted: it covers the whole run)."""
    from dtrun.launcher.job.result import StopReason

    return result.stop is not None and result.stop.reason is StopReason.TIMEOUT


def _cleanup(att: Attempt, hosts: Sequence[str]) -> None:
    """Stop what is left of a failed attempt on ``hosts`` (those that passed the check), at once.

    The attempt's own PMIx namespace goes with it: under Open MPI 5 it is what proves a
    daemon of the failed attempt whose ranks have ended (a frozen or slow ``prted``)."""
    if att.job is None or att.srun or not hosts:
        return  # under srun, Slurm ends the step's processes itself
    from dtrun.launcher.job.kill import kill_leftovers

    kill_leftovers(replace(att.job, hosts=tuple(hosts)), att.nspace, budget=CLEANUP_BUDGET_S)
