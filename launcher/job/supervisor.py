"""Running mpirun as a child: signals, time limits, a failed rank, and the one way a job stops.

mpirun runs in its own session with the argument list (no shell). The supervisor

* stops the job on every catchable terminating signal (``STOP_SIGNALS``), when ``timeout``
  passes, when ranks have not started within ``start_timeout`` (naming the hosts they were
  meant for), and when a rank fails and mpirun does not end the job by itself (MPICH's
  Hydra keeps the other ranks running); observers (the hang watch's --on-hang abort)
  stop it the same way: every cause is one call of ``JobSupervisor.stop``;
* stopping is SIGINT to mpirun once (a terminal's Ctrl-C reaching both would make Open MPI
  skip its clean-up), SIGTERM on a second request, and whatever of mpirun's session is
  still alive ``STOP_GRACE_S`` later (or on a third request) is killed, so dtrun exits
  within a few seconds whatever the network does and leaves no process behind on this
  host (ssh clients included);
* hands the output to ``launcher.job.pumps`` and builds the ``JobResult`` at the end.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from dtrun.launcher.errors import ExitCode, LaunchError, signal_name
from dtrun.launcher.job import parsers, summary
from dtrun.launcher.job.kill import kill_session, send_signal
from dtrun.launcher.job.markers import new_marker_token
from dtrun.launcher.job.observer import JobObserver
from dtrun.launcher.job.pumps import STDOUT_BUFFER_MAX, OutputPumps, PumpHooks
from dtrun.launcher.job import stopsignals
from dtrun.launcher.job.stopsignals import STOP_SIGNALS
from dtrun.launcher.job.result import (SIGPIPE_EXIT, STOP_GRACE_S, JobResult, RankFailure, StopReason, StopState,
                                 exit_code_for, launcher_name, order_failures, root_cause)
from dtrun.launcher.remote.wire import MARKER_TOKEN_ENV

__all__ = ["FAILURE_GRACE_S", "STOP_GRACE_S", "STOP_SIGNALS", "JobObserver", "JobSupervisor", "Limits",
           "StopReason", "StopState", "output_cut_short", "run_job"]

# After a rank's failure marker, mpirun gets this long to end the job by itself (Open MPI
# does within a few seconds); then dtrun stops it (MPICH's Hydra lets the other ranks run on).
FAILURE_GRACE_S = 3.0
ENV_END = "DTRUN_ENV_END"  # the last variable of mpirun's environment (see job_environment)
# The stop requests that escalate: the first sends SIGINT, the second SIGTERM, the third kills.
_SIGTERM_AT, _KILL_AT = 2, 3


@dataclass(frozen=True)
class Limits:
    """When the supervisor stops a job by itself."""

    timeout: Optional[float] = None  # seconds the whole job may take
    start_timeout: Optional[float] = None  # seconds until every rank's wrapper said it started
    expected: tuple = ()  # host name of each rank, to name the hosts whose ranks did not start
    failure_grace: float = FAILURE_GRACE_S  # seconds mpirun gets to end the job after a rank failed
    timeout_limit: Optional[float] = None  # the user's --timeout, for the message (restarts share it)


class JobSupervisor:
    """The job while it runs: what observers may look at, and ``stop``, the one way to stop it."""

    def __init__(self, proc, *, limits: Limits = Limits(), observers: Sequence[JobObserver] = ()):
        self.proc = proc
        self.pid = proc.pid
        self.started_ranks: dict[str, str] = {}
        self.failures: list[RankFailure] = []
        self.wake = threading.Event()
        self.limits = limits
        self.observers = tuple(observers)
        # Re-entrant: the signal handler stops the job on the main thread, which may hold it.
        self._lock = threading.RLock()
        self._requests: list[StopState] = []  # every stop request; the first is why the job stopped
        self._first_failure: Optional[tuple[float, RankFailure]] = None  # (when it arrived, the failure)
        self._forced = False  # mpirun's session on this host had to be killed
        self._t0 = time.monotonic()
        self._own_gate = False

    # -- stopping
    def stop(self, reason: StopReason, detail: str = "", *, signum: Optional[int] = None) -> None:
        """Ask for the job to be stopped (from any thread or a signal handler). The first
        request is the job's stop state; each further one escalates (SIGTERM, then kill)."""
        if not isinstance(reason, StopReason):
            raise TypeError(f"stop reason must be a StopReason, not {reason!r}")
        with self._lock:
            self._requests.append(StopState(reason, detail or reason.value, signum))
        self.wake.set()

    @property
    def stop_state(self) -> Optional[StopState]:
        """Why the job was stopped (the first request), or None while nobody asked."""
        with self._lock:
            return self._requests[0] if self._requests else None

    @property
    def stop_reason(self) -> Optional[StopReason]:
        state = self.stop_state
        return state.reason if state is not None else None

    @property
    def stop_requests(self) -> int:
        with self._lock:
            return len(self._requests)

    @property
    def signum(self) -> Optional[int]:
        """The first terminating signal that reached dtrun (also after another cause stopped the job)."""
        with self._lock:
            return next((r.signum for r in self._requests if r.reason is StopReason.SIGNAL), None)

    @property
    def stdout_closed(self) -> bool:
        with self._lock:
            return any(r.reason is StopReason.STDOUT_CLOSED for r in self._requests)

    # -- what the pumps and the signal handler report
    def _rank_exited(self, failure: RankFailure) -> None:
        self.failures.append(failure)
        for o in self.observers:
            o.on_rank_exit(failure)
        if not failure.torn_down and self._first_failure is None:
            self._first_failure = (time.monotonic(), failure)
            self.wake.set()

    def _rank_started(self, rank: str, host: str) -> None:
        self.started_ranks[rank] = host
        for o in self.observers:
            o.on_rank_start(rank, host)

    def _stdout_gone(self) -> None:
        self.stop(StopReason.STDOUT_CLOSED)

    def _on_signal(self, signum: int) -> bool:
        """A stop signal (through ``stopsignals``); True when an observer consumed it (no stop)."""
        if any(o.on_signal(signum) for o in self.observers):
            return True
        self.stop(StopReason.SIGNAL, f"stopped by {signal_name(signum)}", signum=signum)
        return False

    def attach(self) -> None:
        """Take every stop signal from now on, first those that reached dtrun since mpirun started."""
        self._own_gate = not stopsignals.installed()  # a library caller: handlers for this job only
        if self._own_gate:
            stopsignals.install()
        stopsignals.attach(self._on_signal)

    # -- the run
    def run(self, token: str = "") -> JobResult:
        """Follow the job to its end (the caller started ``proc``) and return its result."""
        pumps = OutputPumps(self.proc, self.observers, PumpHooks(self._rank_exited, self._rank_started,
                                                                 self._stdout_gone), token)
        if not stopsignals.attached():
            self.attach()
        try:
            pumps.start()
            for o in self.observers:
                o.on_start(self)
            # mpirun's end wakes the loop at once (no polling delay added to every job).
            threading.Thread(target=self._reap, daemon=True).start()
            self._supervise()
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._kill()
                self.proc.wait()
        finally:
            stopsignals.detach()
            if self._own_gate:
                stopsignals.uninstall()
        # Nothing of mpirun's session stays behind on this host (ssh clients, prterun helpers),
        # also after a normal end: a daemon's ssh client may linger while its host is silent.
        kill_session(self.proc.pid)
        pumps.join(timeout=5, drain=self.stop_state is None)
        result = self._result(pumps)
        end_observers(self.observers, result)
        return result

    def _reap(self) -> None:
        self.proc.wait()
        self.wake.set()

    def _kill(self) -> None:
        self._forced = True
        kill_session(self.proc.pid)

    def _supervise(self) -> None:
        """Wait for mpirun, stopping the job when asked (or a limit passes) and escalating."""
        stopping_since: Optional[float] = None
        sent = 0  # signals sent to mpirun
        while self.proc.returncode is None:
            self.wake.clear()
            now = time.monotonic()
            self._check_limits(now)
            requests = self.stop_requests
            if requests:
                stopping_since = now if stopping_since is None else stopping_since
                while sent < min(requests, _SIGTERM_AT):
                    sent += 1
                    send_signal(self.proc, signal.SIGINT if sent == 1 else signal.SIGTERM)
                if now - stopping_since > STOP_GRACE_S or requests >= _KILL_AT:
                    self._kill()
                    return
                wait = STOP_GRACE_S - (now - stopping_since)
            else:
                wait = self._next_check(now)
            if self.proc.returncode is None:
                self.wake.wait(max(wait, 0.01))

    def _waiting_for_ranks(self) -> bool:
        expected = self.limits.expected
        return self.limits.start_timeout is not None and bool(expected) and len(self.started_ranks) < len(expected)

    def _check_limits(self, now: float) -> None:
        """Stop the job when a time limit passed or a failed rank's grace is over (unless stopping)."""
        lim = self.limits
        if self.stop_state is not None:
            return
        if lim.timeout is not None and now - self._t0 > lim.timeout:
            self.stop(StopReason.TIMEOUT, summary.timeout_message(lim.timeout_limit or lim.timeout))
        elif self._waiting_for_ranks() and now - self._t0 > lim.start_timeout:
            self.stop(StopReason.START_TIMEOUT,
                      summary.not_started_message(lim.expected, self.started_ranks, lim.start_timeout))
        elif self._first_failure is not None and now - self._first_failure[0] > lim.failure_grace:
            _, failure = self._first_failure
            self.stop(StopReason.RANK_FAILED, f"rank {failure.rank} on {failure.host} {failure.how}")

    def _next_check(self, now: float) -> float:
        """Seconds until the next limit may pass (at most one)."""
        lim, wait = self.limits, 1.0
        if lim.timeout is not None:
            wait = min(wait, self._t0 + lim.timeout - now)
        if self._waiting_for_ranks():
            wait = min(wait, self._t0 + lim.start_timeout - now)
        if self._first_failure is not None:
            wait = min(wait, self._first_failure[0] + lim.failure_grace - now)
        return wait

    # -- the result
    def _result(self, pumps: OutputPumps) -> JobResult:
        mpirun_rc, stop = self.proc.returncode, self.stop_state
        launcher = launcher_name(self.proc.args)
        with self._lock:
            stops = tuple(self._requests)
        if stop is not None and stop.reason is StopReason.HANG:  # the hang watch's --on-hang abort
            return JobResult(returncode=ExitCode.HANG, mpirun_returncode=mpirun_rc, stops=stops, launcher=launcher,
                             launcher_pid=self.pid)
        signum = self.signum
        timed_out = stop.detail if stop is not None and stop.reason in (StopReason.TIMEOUT,
                                                                        StopReason.START_TIMEOUT) else None
        failures = self._ordered_failures(pumps, mpirun_rc, signum is not None)
        stderr_tail = pumps.stderr_text()
        lost = None
        if root_cause(failures) is None:
            lost = parsers.lost_daemon_host(stderr_tail) or parsers.dropped_daemon_host(
                stderr_tail + pumps.stdout_tail_text(), self.started_ranks.values())
        vanished = []
        if mpirun_rc != 0 and root_cause(failures) is None and not lost and signum is None and timed_out is None:
            vanished = self._vanished(pumps)
        notes = []
        missing = output_cut_short(self, pumps.eof_ranks, mpirun_rc == 0 and stop is None and not lost)
        if missing:
            notes.append(summary.cut_short_note(missing, self.started_ranks))
        if pumps.throttled:
            notes.append(summary.throttled_note(launcher, STDOUT_BUFFER_MAX))
        return JobResult(
            returncode=self._exit_code(mpirun_rc, failures, signum, timed_out, lost), mpirun_returncode=mpirun_rc,
            failures=failures, stops=stops, lost_daemon_host=lost, vanished=vanished, notes=notes,
            forced=self._forced,
            pmix_refused=None if self.started_ranks else parsers.pmix_refusal(stderr_tail + "".join(pumps.stdout_head)),
            launcher=launcher, launcher_pid=self.pid)

    def _ordered_failures(self, pumps: OutputPumps, mpirun_rc: int, interrupted: bool) -> list[RankFailure]:
        """The ranks' failures, root cause first; the launcher's own report where no marker named one."""
        failures = order_failures(self.failures, pumps.reported_rank())
        killed = pumps.killed_rank() if self.stop_state is None else None  # not one dtrun stopped
        if killed is not None and all(f.rank != killed.rank for f in failures):
            # Killed with its wrapper (no marker): Open MPI's report is all there is of the cause,
            # and another rank's abort that it provoked must not take its place.
            failures = order_failures(failures + [killed], pumps.reported_rank())
        if root_cause(failures) is None and mpirun_rc != 0 and not interrupted:
            fb = pumps.fallback_failure()
            if fb:
                expected = self.limits.expected
                if fb.host == "?" and fb.rank.isdigit() and int(fb.rank) < len(expected):
                    fb.host = self.started_ranks.get(fb.rank) or expected[int(fb.rank)]
                failures.insert(0, fb)
        return failures

    def _exit_code(self, mpirun_rc: int, failures: list, signum: Optional[int], timed_out: Optional[str],
                   lost: Optional[str]) -> int:
        if signum is not None:
            rc = exit_code_for(mpirun_rc, failures, True, signum)
        elif timed_out is not None:
            rc = ExitCode.TIMEOUT
        elif self.stdout_closed and root_cause(failures) is None:
            rc = SIGPIPE_EXIT
        else:
            rc = exit_code_for(mpirun_rc, failures, False)
        if lost and rc == 0:
            rc = ExitCode.FAILED  # Open MPI 5 was seen to exit 0 after losing a daemon and its ranks
        return rc

    def _vanished(self, pumps: OutputPumps) -> list:
        """Open MPI does not always say which daemon it lost: the ranks that started and then sent
        neither an exit report nor their last output line went down with their host or daemon."""
        heard = {f.rank for f in self.failures} | pumps.eof_ranks
        quiet = [(r, h) for r, h in sorted(self.started_ranks.items(), key=lambda t: (len(t[0]), t[0]))
                 if r not in heard]
        return quiet if quiet and len(quiet) < len(self.started_ranks) else []


def end_observers(observers: Sequence[JobObserver], result: JobResult) -> None:
    """Every observer's ``on_end`` at once, each in a thread of its own, and wait for all.

    Several wait on the hosts (the straggler watch for its agents' last window, the hang
    watch for its agents): in turn, a host that crashed would make the job's end wait for
    each of them, and the reap of what the job left would start only after the others. Each
    ``on_end`` bounds its own waits. The first error one raised is raised here."""
    errors: list[BaseException] = []

    def end(o: JobObserver) -> None:
        try:
            o.on_end(result)
        except BaseException as exc:  # handed to the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=end, args=(o,), name=f"dtrun-end-{type(o).__name__}") for o in observers[1:]]
    for t in threads:
        t.start()
    if observers:
        end(observers[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def output_cut_short(job: JobSupervisor, eof_ranks: set, succeeded: bool) -> list[str]:
    """Ranks whose wrapper wrote its end-of-output line that never arrived.

    After a clean end (``succeeded``) every started rank wrote it; after a failure, every rank
    whose exit marker arrived did (it is written just before that marker). mpirun's exit code 0
    alone is no clean end: Open MPI 5 exits 0 after losing a daemon, when the ranks were killed
    before their wrappers wrote anything (and those of the lost host with it).
    """
    if succeeded:
        wrote = set(job.started_ranks)
    else:
        wrote = {f.rank for f in job.failures}
    return sorted((r for r in wrote if r not in eof_ranks), key=lambda r: (len(r), r))


def job_environment(env: Optional[dict], token: str) -> dict:
    """mpirun's environment: ``env`` (default: dtrun's own) with the job's marker token."""
    # The rank wrappers read this job's marker token from their environment: mpirun forwards it
    # (-x / -genvlist, launcher/command.py), srun exports all of its own.
    env = dict(os.environ if env is None else env)
    env[MARKER_TOKEN_ENV] = token
    # MPICH 4.0's Hydra drops the last variable of mpiexec's environment when it forwards
    # -genvlist names to hosts it reaches over ssh: keep a variable nobody forwards last.
    env.pop(ENV_END, None)
    env[ENV_END] = "1"
    return env


def _grow_pipe(stream) -> None:
    """A larger pipe from mpirun (Linux): fewer stalls of its output while dtrun writes ours."""
    try:
        import fcntl

        fcntl.fcntl(stream.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (OSError, ValueError, ImportError):
        pass


def run_job(argv: Sequence[str], env: Optional[dict] = None, *, timeout: Optional[float] = None,
            start_timeout: Optional[float] = None, expected: Sequence[str] = (),
            observers: Sequence[JobObserver] = (), failure_grace: float = FAILURE_GRACE_S,
            timeout_limit: Optional[float] = None) -> JobResult:
    """Run mpirun with ``argv`` and wait, handling signals and time limits. Never uses a shell.

    Args:
        timeout: seconds the whole job may take (None: no limit).
        timeout_limit: the --timeout the message names, when ``timeout`` is what is left of it.
        start_timeout: seconds until every rank's wrapper must have said it started (None: no limit).
        expected: host name of each rank, to name the hosts whose ranks did not start.
        observers: hooks that follow the job (see JobObserver), such as the hang watch
            (launcher/hangwatch.HangWatch): SIGQUIT prints every rank's stack and the job goes
            on; with --hang-timeout it may stop the job.
        failure_grace: seconds mpirun gets to end the job after a rank failed before dtrun stops it.
    """
    stdin = subprocess.DEVNULL if sys.stdin is None or sys.stdin.isatty() else None
    token = new_marker_token()
    limits = Limits(timeout, start_timeout, tuple(expected), failure_grace, timeout_limit)
    # From just before mpirun exists until its supervisor takes the signals, a stop signal is
    # recorded, then handed over: no moment where mpirun runs with nobody to stop it.
    with stopsignals.held():
        try:
            proc = subprocess.Popen(list(argv), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=job_environment(env, token), start_new_session=True)
        except OSError as exc:
            raise LaunchError(f"cannot start {argv[0]}: {exc.strerror}") from None
        _grow_pipe(proc.stdout)
        job = JobSupervisor(proc, limits=limits, observers=observers)
        job.attach()
    return job.run(token)
