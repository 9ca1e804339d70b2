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

from dtrun.launcher import elastic, jobstate, sshmux
from dtrun.launcher.attempt import AttemptOutcome, run_attempt
from dtrun.launcher.errors import ExitCode, UsageError, signal_name
from dtrun.launcher.hangwatch import ON_HANG
from dtrun.launcher.hostfile import HostSlots
from dtrun.launcher.hosts import all_local, is_local, resolve_hosts, resolve_np
from dtrun.launcher.job import stopsignals
from dtrun.launcher.job.kill import AgentRound, kill_leftovers, run_host_agents, start_kill, wait_agents
from dtrun.launcher.job.result import JobResult, StopReason, root_cause
from dtrun.launcher.launch import AttemptSetup, LaunchOptions, Preflight, check_seconds
from dtrun.launcher.paths import new_run_id
from dtrun.launcher.restarts import (ErrorWatch, Failure, HostCheck, NotEnoughSlots, attempt_line, check_options,
                                     failure_of, going_on_without, lost_host_lines, lost_hosts, plan_hosts,
                                     repeated_failure, slots_left)
from dtrun.launcher.sshmux import Masters
from dtrun.launcher.sshnames import ssh_hostnames

# Seconds the kill agents get to stop what is left of a failed attempt on its hosts.
CLEANUP_BUDGET_S = 5.0
# Seconds a restart's check waits for the kill round's answer from a host before it checks
# that host's sshd instead (a healthy host's agent answers in a tenth of that over the run's
# ssh connection).
KILL_ANSWER_WAIT_S = 1.0
# Seconds the host agents get to remove a failed run's elastic commits.
FORGET_BUDGET_S = 3.0


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
    opts = elastic.discovery_options(opts, environ)  # --host-discovery-script implies --max-restarts
    check_options(opts, None)
    if opts.dry_run or not opts.rank_wrapper:
        return run_attempt(opts, AttemptSetup(), preflight).code
    # One attempt, or with --max-restarts several, each in a job directory of its own where
    # ranks leave state for `dtrun stacks` (launcher/remote/rankstate.py).
    loop = _Run(opts, preflight, host_check, os.environ if environ is None else environ, timings)
    if not loop.restarts:
        return loop.one()  # a stop signal outside the job ends dtrun in cli.main
    code = None
    try:
        while True:
            code = loop.one()
            if code is not None:
                return code
    except stopsignals.Stopped as exc:
        _say(f"dtrun: stopped by {signal_name(exc.signum)} between attempts; no further attempt")
        code = stopsignals.exit_code(exc.signum)
        return code
    finally:
        with stopsignals.held():
            try:
                if code != 0:
                    loop.forget_commits()
            finally:
                loop.close()


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
        # hvd.elastic's commits are kept per run on each host (dtrun/commitstore.py)
        self.run_id = new_run_id()
        self.discovery = opts.host_discovery_script  # launcher/elastic.py
        self.max_np = opts.max_np
        self.flaps = elastic.FlapRule()
        self.resets = 0  # attempts started for a change of hosts (not counted by --max-restarts)
        self.ran_on: dict[str, None] = {}  # every host an attempt ran on, in order
        self.last_job = None  # the last attempt's record: how its host agents are reached
        # With restarts, dtrun's own sessions to the hosts share one connection per host (launcher/sshmux.py).
        self.masters: Optional[Masters] = None
        if self.restarts:
            self.selection = resolve_hosts(opts.hosts, environ)
            self.spares, self.min_np = check_options(opts, self.selection)
            self.np = resolve_np(opts.np, self.selection, opts.oversubscribe)
            if self.min_np is not None and self.min_np > self.np:
                raise UsageError(f"--min-np {self.min_np} is more than -np {self.np}")
            self.plan = plan_hosts(self.selection.hosts, (), (), self.np, None, opts.oversubscribe)
            self.first = tuple(h.host for h in self.plan.hosts)
            self.base_id = new_run_id() if opts.log_dir else None
            self.masters = Masters()
            sshmux.activate(self.masters)
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
                       env=tuple(self.opts.env) + (f"DTRUN_RESTART_COUNT={n}", f"TORCHELASTIC_RESTART_COUNT={n}",
                                                   f"DTRUN_RUN_ID={self.run_id}"))
        # A later attempt's mpirun reaches the hosts through the run's ssh connections (launcher/sshmux.py).
        control = self.masters.shared_path() if self.masters is not None and n > 0 else None
        return opts, AttemptSetup(job_dir=job_dir, selection=replace(self.selection, hosts=self.plan.hosts),
                                  run_id=f"{self.base_id}-attempt-{n + 1}" if self.base_id else None,
                                  deadline=self.deadline, ssh_control_path=control)

    def one(self) -> Optional[int]:
        """Run one attempt; dtrun's exit code when the run is over, None to go on."""
        job_dir = jobstate.new_dir()
        going_on = False
        try:
            watch = ErrorWatch()
            opts, setup = self._inputs(job_dir)
            if self.timings is not None and self.n > 0:
                self.timings.relaunched.append(time.monotonic())
            hosts_watch = self._host_watch(job_dir)
            observers = (watch,) if hosts_watch is None else (watch, hosts_watch)
            att = run_attempt(opts, setup, self.preflight, observers, cleanup=not self.restarts,
                              masters=self.masters)
            self.ran_on.update(dict.fromkeys(att.hosts))
            self.last_job = att.job or self.last_job
            if self.timings is not None:
                self.timings.detected.append(time.monotonic())
            if att.code == 0 or att.result is None:
                return att.code
            if hosts_watch is not None and hosts_watch.posted and elastic.is_reset(root_cause(att.result.failures)):
                if not att.cleaned:
                    with stopsignals.held():
                        _cleanup(att, att.hosts)
                return self._reset(hosts_watch.posted, att.hosts)
            if self.discovery:
                self._refresh()
            failure = failure_of(att.result, watch.exception(), self.opts.on_hang, _timed_out(att.result))
            if att.ended:
                failure = replace(failure, restartable=False, reason="Slurm stopped the job")
            # The clean-up starts at once on every host of the attempt and runs while the hosts
            # are checked; the next attempt waits for it only on the hosts it may use. On those
            # left out it ends in the background, within its budget, and before dtrun exits.
            cleanup = _start_cleanup(att) if self.restarts and not att.cleaned else None
            try:
                bad = self._check_hosts(att, opts, failure, watch, cleanup)
            except stopsignals.Stopped:
                if cleanup is not None:
                    with stopsignals.held():
                        cleanup.wait()
                raise
            t0 = time.monotonic()
            if cleanup is not None:
                with stopsignals.held():  # a signal now waits for the clean-up, then ends the run
                    cleanup.wait([h for h in att.hosts if h not in bad])
            if self.timings is not None:
                self.timings.cleanup.append(time.monotonic() - t0)
            code = self._next(att, failure, bad)
            going_on = code is None
            return code
        finally:
            try:
                if not going_on:  # the run ends: no round of agents it started is left running
                    with stopsignals.held():
                        wait_agents()
            finally:
                jobstate.remove(job_dir)

    def _check_hosts(self, att: AttemptOutcome, opts: LaunchOptions, failure: Failure,
                     watch: Optional[ErrorWatch] = None, cleanup: Optional[AgentRound] = None) -> dict[str, str]:
        """The hosts that fail the check after this failure (host -> why), each lost one said.
        Before a restart the check is quick where the run can go on without a host (``_recovery_check``;
        ``cleanup``: the kill round in flight, whose answers prove their hosts)."""
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
            if self.restarts and failure.restartable:
                bad = self._recovery_check(att, opts, used, candidates, watch, cleanup)
            else:
                bad = dict(self.host_check(opts, used, candidates, self.environ))
        if self.timings is not None:
            self.timings.check.append(time.monotonic() - t0)
        for line in lost_host_lines({h: w for h, w in bad.items() if h in att.hosts}, att.rank_hosts):
            _say(line)
        return bad

    def _recovery_check(self, att: AttemptOutcome, opts: LaunchOptions, used, candidates: Sequence[HostSlots],
                        watch: Optional[ErrorWatch], cleanup: Optional[AgentRound] = None) -> dict[str, str]:
        """The check before a restart (launcher/restarts.py): a host the failure's evidence names
        as lost is left out at once when the next attempt fits without it. A host whose agent of
        the kill round (``cleanup``) answers within ``KILL_ANSWER_WAIT_S`` passes: it ran a
        program there just now, over the run's ssh connection to it (launcher/sshmux.py), which
        proves more than the check's ssh banner and spares its sshd a connection. The others get
        the quick check, and one that fails it is left out too when the attempt fits without
        it. Only a host the next attempt cannot do without gets the check's full timeout."""
        names = {h.host for h in candidates if not is_local(h.host)}  # never this host: dtrun runs on it
        closed = _closed_hosts(att, watch.closed() if watch is not None else ())
        if self.masters is not None:  # mpirun's ssh through a master says nothing of the close: the master does
            closed += [h for h in self.masters.closed_hosts() if h in att.hosts and h not in closed]
        evidence = {h: why for h, why in lost_hosts(att.result, att.rank_hosts, closed).items() if h in names}
        fits = slots_left(self.selection.hosts, self.spares, list(self.left_out), self.np, self.min_np,
                          self.opts.oversubscribe)
        out, needed = going_on_without(list(evidence), fits)
        bad = {h: evidence[h] for h in out}
        rest = [h for h in candidates if h.host not in evidence]
        if cleanup is not None and rest:
            answered = cleanup.answered_within([h.host for h in rest if h.host in names], KILL_ANSWER_WAIT_S)
            rest = [h for h in rest if h.host not in answered]
        slow = dict(self.host_check(opts, used, rest, self.environ, quick=True)) if rest and not all_local(rest) else {}
        more, kept = going_on_without(list(slow), fits, list(bad))
        bad.update((h, slow[h]) for h in more)
        again = [h for h in candidates if h.host in needed or h.host in kept]
        if again:
            bad.update(self.host_check(opts, used, again, self.environ))
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
        if self.n - self.resets + 1 >= self.total:
            _say(f"dtrun: not restarting: all {self.total} attempts (--max-restarts {self.opts.max_restarts}) "
                 f"failed; the last: {failure.what} (exit code {int(ExitCode.RESTARTS)})")
            return ExitCode.RESTARTS
        if self.deadline is not None and time.monotonic() >= self.deadline:
            _say(f"dtrun: not restarting: the run used all of --timeout {self.opts.timeout:g} s (it counts "
                 f"across attempts); the last: {failure.what} (exit code {int(ExitCode.TIMEOUT)})")
            return ExitCode.TIMEOUT
        self.left_out.update(bad)
        try:
            if self.discovery:
                self._plan_listed(att.hosts, bad)
            else:
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
        _say(attempt_line(self.n - self.resets + 1, self.total, failure, dict(bad), self.plan))
        return None

    def forget_commits(self) -> None:
        """The run ended without success: remove its hvd.elastic commits (dtrun/commitstore.py)
        on the hosts it ran on and can still reach. (After a success the ranks removed them.)"""
        hosts = [h for h in self.ran_on if h not in self.left_out]
        if self.last_job is not None and hosts:
            run_host_agents(self.last_job, "forget", hosts, FORGET_BUDGET_S, (self.run_id,))

    def close(self) -> None:
        """The run is over: end its ssh master connections (after every agent round has ended)."""
        if self.masters is not None:
            wait_agents()
            sshmux.activate(None)
            self.masters.close()

    # -- elastic runs (--host-discovery-script, launcher/elastic.py)
    def _host_watch(self, job_dir: str) -> Optional[elastic.HostWatch]:
        if not (self.discovery and self.restarts and self.plan.rank_hosts):
            return None
        return elastic.HostWatch(job_dir, self.plan.rank_hosts[0], [h.host for h in self.plan.hosts], self.plan.np,
                                 self.max_np, kept_out=lambda: [h for h in self.flaps.lost if self.flaps.barred(h)],
                                 listed=lambda: elastic.run_discovery(self.discovery, self.environ),
                                 usable=self._usable)

    def _usable(self, hosts: Sequence[HostSlots]) -> Mapping[str, str]:
        """The host check on ``hosts``: {host: why} of those that fail it."""
        if self.host_check is None or not hosts or all_local(hosts):
            return {}
        return dict(self.host_check(self.opts, self.selection, list(hosts), self.environ))

    def _refresh(self) -> None:
        """The hosts the discovery script lists now become the run's (kept when it fails)."""
        try:
            listed = elastic.run_discovery(self.discovery, self.environ)
        except elastic.DiscoveryError as exc:
            _say(f"dtrun: warning: {exc}; the hosts it listed last are used")
            return
        if listed:
            self.selection = replace(self.selection, hosts=tuple(listed))

    def _plan_listed(self, before: Sequence[str], bad: Mapping[str, str]) -> None:
        """The next attempt of an elastic run: every usable listed slot up to --max-np, less the
        hosts that failed the check now and those lost too often (``FlapRule``); a host lost
        once before may come back when it passes the check.

        Raises:
            NotEnoughSlots: fewer slots than --min-np (else the first -np).
        """
        for h in bad:
            if h in before:
                self.flaps.record(h)
        out = {h: why for h, why in bad.items()}
        out.update({h: self.flaps.why(h) for h in self.flaps.lost if self.flaps.barred(h)})
        back = [h for h in self.selection.hosts if h.host not in before and h.host not in out]
        out.update(self._usable(back))
        self.left_out = out
        usable = [h for h in self.selection.hosts if h.host not in out]
        floor = self.min_np if self.min_np is not None else self.np
        try:
            n = elastic.target_np(sum(max(int(h.slots), 1) for h in usable), self.max_np, floor)
        except ValueError as exc:
            gone = ", ".join(out) or "none"
            raise NotEnoughSlots(f"{exc} (left out: {gone})") from None
        self.plan = plan_hosts(self.selection.hosts, (), list(out), n, None, self.opts.oversubscribe, self.first)

    def _reset(self, change: elastic.Change, before: Sequence[str]) -> Optional[int]:
        """Every rank left at a commit after dtrun posted ``change``: the next attempt runs on the
        hosts listed now and resumes from that commit. The exit code when none can. The hosts
        of the attempt that just ended well (``before``) are not checked again."""
        for h in change.removed:
            self.flaps.record(h)
        self._refresh()
        try:
            self._plan_listed([h for h in before if h not in change.removed], {})
        except NotEnoughSlots as exc:
            _say(f"dtrun: not restarting: {exc}; the hosts changed ({change.words()}) (exit code "
                 f"{int(ExitCode.RESTARTS)})")
            return ExitCode.RESTARTS
        self.n += 1
        self.resets += 1
        self.first = tuple(h.host for h in self.plan.hosts)  # the hosts the job grew onto are its own, not spares
        where = ", ".join(h.host for h in self.plan.hosts)
        _say(f"dtrun: the hosts changed ({change.words()}); the job resumes from its last commit; "
             f"{self.plan.np} rank{'s' if self.plan.np != 1 else ''} on {where}")
        return None


def _timed_out(result: JobResult) -> bool:
    """Whether the run's --timeout stopped the attempt (never restarted: it covers the whole run)."""
    return result.stop_reason is StopReason.TIMEOUT


def _start_cleanup(att: AttemptOutcome) -> Optional[AgentRound]:
    """``_cleanup`` on every host of the attempt, started and not waited for (``AgentRound.wait``)."""
    if att.job is None or att.srun or not att.hosts:
        return None
    return start_kill(att.job, att.hosts, att.nspace, budget=CLEANUP_BUDGET_S)


def _closed_hosts(att: AttemptOutcome, addresses: Sequence[str]) -> list[str]:
    """The attempt's hosts whose ssh connection was closed by the far end (``addresses``: as
    ssh names them, after the HostName of the ssh config mpirun used, which `ssh -G` reads)."""
    hosts = [h for h in dict.fromkeys(att.hosts) if not is_local(h)]
    found = [h for h in hosts if h in addresses]
    rest = [h for h in hosts if h not in found]
    if not rest or all(a in found for a in addresses):
        return found
    where = att.ssh_names.get(rest) if att.ssh_names is not None else \
        ssh_hostnames(att.job.ssh_config if att.job is not None else None, rest)
    return found + [h for h in rest if where.get(h) in addresses]


def _cleanup(att: AttemptOutcome, hosts: Sequence[str]) -> None:
    """Stop what is left of a failed attempt on ``hosts`` (those that passed the check), at once.

    The attempt's own PMIx namespace goes with it: under Open MPI 5 it is what proves a
    daemon of the failed attempt whose ranks have ended (a frozen or slow ``prted``)."""
    if att.job is None or att.srun or not hosts:
        return  # under srun, Slurm ends the step's processes itself
    kill_leftovers(att.job, hosts, att.nspace, budget=CLEANUP_BUDGET_S)
