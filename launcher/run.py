"""A run of the job: one attempt or, with ``--max-restarts``, several. This module owns the loop.

``launch`` is the launch command's work, from the CLI's options to dtrun's exit code. It
checks the options, then runs attempts one after the other (``launcher.attempt.run_attempt``),
each with an ``AttemptSetup`` settled here (its job directory, hosts, log subdirectory and
what is left of the run's ``--timeout``), each handing back an immutable ``AttemptOutcome``.
After a failed attempt the rules of launcher/restarts.py decide: the hosts are checked,
what is left of the attempt is stopped on those that pass (launcher/job/kill.py), and the
next attempt starts or the run ends. Nothing below calls back up: the attempt knows nothing
of restarts. Like torchrun's ``SimpleElasticAgent._invoke_run``, one owner for the loop.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

from dtrun.launcher import jobstate
from dtrun.launcher.attempt import AttemptOutcome, run_attempt
from dtrun.launcher.errors import ExitCode, UsageError, signal_name
from dtrun.launcher.hangwatch import ON_HANG
from dtrun.launcher.hostfile import HostSlots
from dtrun.launcher.hosts import all_local, resolve_hosts, resolve_np
from dtrun.launcher.job import stopsignals
from dtrun.launcher.job.kill import kill_leftovers
from dtrun.launcher.job.result import JobResult, StopReason
from dtrun.launcher.launch import AttemptSetup, LaunchOptions, Preflight, check_seconds
from dtrun.launcher.paths import new_run_id
from dtrun.launcher.restarts import (ErrorWatch, Failure, HostCheck, NotEnoughSlots, attempt_line, check_options,
                                     failure_of, lost_host_lines, plan_hosts, repeated_failure)

# Seconds the kill agents get to stop what is left of a failed attempt on the healthy hosts.
CLEANUP_BUDGET_S = 5.0


@dataclass
class Timings:
    """Seconds of each step between a fault and the next attempt (benchmarks/bench_restarts.py)."""

    detected: list = field(default_factory=list)  # monotonic time the attempt ended
    check: list = field(default_factory=list)
    cleanup: list = field(default_factory=list)
    relaunched: list = field(default_factory=list)  # monotonic time the next attempt started


def launch(opts: LaunchOptions, preflight: Optional[Preflight] = None, host_check: Optional[HostCheck] = None,
           environ: Optional[Mapping[str, str]] = None, timings: Optional[Timings] = None) -> int:
    """Run (or with --dry-run, print) the job; return dtrun's exit code (``preflight``: see
    ``launch.prepare``).

    ``host_check`` (given by the CLI: ``checks.hostcheck.check_hosts``) checks the hosts after
    a failure: those that fail it are named, and left out of a restart (launcher/restarts.py).
    """
    if opts.hang_timeout is not None and not opts.hang_timeout > 0:
        raise UsageError(f"--hang-timeout {opts.hang_timeout:g}: give a number of seconds above 0")
    if opts.on_hang not in ON_HANG:
        raise UsageError(f"--on-hang {opts.on_hang!r}: use one of {', '.join(ON_HANG)}")
    check_seconds(opts.timeout, "--timeout")
    check_seconds(opts.start_timeout, "--start-timeout")
    check_options(opts, None)
    if opts.dry_run or not opts.rank_wrapper:
        return run_attempt(opts, AttemptSetup(), preflight).code
    # One attempt, or with --max-restarts several, each in a job directory of its own where
    # ranks leave state for `dtrun stacks` (launcher/remote/rankstate.py).
    loop = _Run(opts, preflight, host_check, os.environ if environ is None else environ, timings)
    if not loop.restarts:
        return loop.one()  # a stop signal outside the job ends dtrun in cli.main
    try:
        while True:
            code = loop.one()
            if code is not None:
                return code
    except stopsignals.Stopped as exc:
        _say(f"dtrun: stopped by {signal_name(exc.signum)} between attempts; no further attempt")
        return stopsignals.exit_code(exc.signum)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Run:
    """The attempts of one run: the hosts planned, those left out and why, the failure of
    the earlier attempts (a failure seen again on good hosts is the program's own)."""

    def __init__(self, opts: LaunchOptions, preflight: Optional[Preflight], host_check: Optional[HostCheck],
                 environ: Mapping[str, str], timings: Optional[Timings]):
        # The options every attempt starts from: the user's, and after a failed srun step
        # --overlap without the preflight (``_next``).
        self.opts, self.preflight = opts, preflight
        self.host_check, self.environ, self.timings = host_check, environ, timings
        self.restarts = opts.max_restarts > 0
        self.selection = self.plan = None
        self.spares: tuple[HostSlots, ...] = ()
        self.min_np = self.np = None
        self.first: tuple[str, ...] = ()
        self.base_id = None  # --log-dir: the run's subdirectory name, each attempt's with its number
        if self.restarts:
            self.selection = resolve_hosts(opts.hosts, environ)
            self.spares, self.min_np = check_options(opts, self.selection)
            self.np = resolve_np(opts.np, self.selection, opts.oversubscribe)
            if self.min_np is not None and self.min_np > self.np:
                raise UsageError(f"--min-np {self.min_np} is more than -np {self.np}")
            self.plan = plan_hosts(self.selection.hosts, (), (), self.np, None, opts.oversubscribe)
            self.first = tuple(h.host for h in self.plan.hosts)
            self.base_id = new_run_id() if opts.log_dir else None
        self.left_out: dict[str, str] = {}
        self.healthy_failures: dict[tuple, int] = {}  # failure key -> first attempt (0-based) it ended on good hosts
        self.total = opts.max_restarts + 1
        self.n = 0
        # --timeout is the run's: every attempt gets what is left of it (AttemptSetup.deadline).
        self.deadline = time.monotonic() + opts.timeout if opts.timeout is not None and opts.timeout > 0 else None

    def _inputs(self, job_dir: str) -> tuple[LaunchOptions, AttemptSetup]:
        """The options and setup of attempt ``n``: its hosts, rank count, restart count, run id, deadline."""
        if not self.restarts:
            return self.opts, AttemptSetup(job_dir=job_dir)
        n = self.n
        opts = replace(self.opts, np=str(self.plan.np),
                       env=tuple(self.opts.env) + (f"DTRUN_RESTART_COUNT={n}", f"TORCHELASTIC_RESTART_COUNT={n}"))
        return opts, AttemptSetup(job_dir=job_dir, selection=replace(self.selection, hosts=self.plan.hosts),
                                  run_id=f"{self.base_id}-attempt-{n + 1}" if self.base_id else None,
                                  deadline=self.deadline)

    def one(self) -> Optional[int]:
        """Run one attempt; dtrun's exit code when the run is over, None to go on."""
        job_dir = jobstate.new_dir()
        try:
            watch = ErrorWatch()
            opts, setup = self._inputs(job_dir)
            if self.timings is not None and self.n > 0:
                self.timings.relaunched.append(time.monotonic())
            att = run_attempt(opts, setup, self.preflight, (watch,), cleanup=not self.restarts)
            if self.timings is not None:
                self.timings.detected.append(time.monotonic())
            if att.code == 0 or att.result is None:
                return att.code
            failure = failure_of(att.result, watch.exception(), self.opts.on_hang, _timed_out(att.result))
            if att.ended:
                failure = replace(failure, restartable=False, reason="Slurm stopped the job")
            try:
                bad = self._check_hosts(att, opts, failure)
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

    def _check_hosts(self, att: AttemptOutcome, opts: LaunchOptions, failure: Failure) -> dict[str, str]:
        """The hosts that fail the check after this failure (host -> why), each lost one said."""
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
            bad = dict(self.host_check(opts, used, candidates, self.environ))
        if self.timings is not None:
            self.timings.check.append(time.monotonic() - t0)
        for line in lost_host_lines({h: w for h, w in bad.items() if h in att.hosts}, att.rank_hosts):
            _say(line)
        return bad

    def _next(self, att: AttemptOutcome, failure: Failure, bad: dict[str, str]) -> Optional[int]:
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


def _timed_out(result: JobResult) -> bool:
    """Whether the run's --timeout stopped the attempt (never restarted: it covers the whole run)."""
    return result.stop_reason is StopReason.TIMEOUT


def _cleanup(att: AttemptOutcome, hosts: Sequence[str]) -> None:
    """Stop what is left of a failed attempt on ``hosts`` (those that passed the check), at once.

    The attempt's own PMIx namespace goes with it: under Open MPI 5 it is what proves a
    daemon of the failed attempt whose ranks have ended (a frozen or slow ``prted``)."""
    if att.job is None or att.srun or not hosts:
        return  # under srun, Slurm ends the step's processes itself
    kill_leftovers(att.job, hosts, att.nspace, budget=CLEANUP_BUDGET_S)
