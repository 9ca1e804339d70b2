"""The typed records of a job's end: why dtrun stopped it, how each rank ended, and the result.

Pure values: no process, no I/O. ``launcher.job.summary`` renders them; the exit code
follows from them here (``exit_code_for``).
"""
from __future__ import annotations

import enum
import os
import signal
from dataclasses import dataclass
from typing import Optional, Sequence

from dtrun.launcher.errors import ExitCode, signal_exit_code, signal_name

# Signals mpirun sends to the other ranks while it tears a failed job down (for markers
# from wrappers that do not say whether they forwarded the signal).
TEARDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGHUP})
SIGPIPE_EXIT = 128 + 13
# mpirun gets this long after SIGINT to stop its ranks; then its whole session is killed.
STOP_GRACE_S = 4.0


class StopReason(enum.Enum):
    """Why dtrun stopped a job (the launcher ending a job by itself is not a stop)."""

    SIGNAL = "signal"  # a terminating signal reached dtrun (Ctrl-C, SIGTERM, a Slurm allocation's end)
    TIMEOUT = "timeout"  # --timeout
    START_TIMEOUT = "start timeout"  # --start-timeout: ranks had not started
    RANK_FAILED = "rank failed"  # a rank failed and the launcher let the others run on
    HANG = "hang"  # --on-hang abort or restart (launcher/hangwatch.py)
    STDOUT_CLOSED = "stdout closed"  # dtrun's own stdout went away (| head)


@dataclass(frozen=True)
class StopState:
    """One request to stop the job: the first one a job gets is why it was stopped."""

    reason: StopReason
    detail: str  # a sentence for the user ("the job ran longer than --timeout 5 s"), or a short tag
    signum: Optional[int] = None  # the signal, for StopReason.SIGNAL


@dataclass
class RankFailure:
    rank: str
    host: str
    code: Optional[int] = None
    signum: Optional[int] = None
    start_error: Optional[str] = None  # the rank wrapper could not start the program ("command not found")
    program: Optional[str] = None
    forwarded: Optional[bool] = None  # signal from the launcher's tear-down (None: unknown)
    time: Optional[float] = None  # when the rank ended (its host's clock)

    @property
    def how(self) -> str:
        if self.start_error:
            return f"could not start {self.program}: {self.start_error}"
        if self.signum is not None:
            return f"killed by {signal_name(self.signum)}"
        if self.code is None:
            return "aborted the job"
        return f"exited with code {self.code}"

    @property
    def torn_down(self) -> bool:
        """Killed by the launcher while it stopped the job (a consequence, not a cause)."""
        if self.signum is None:
            return False
        if self.forwarded is not None:
            return self.forwarded
        return self.signum in TEARDOWN_SIGNALS

    def exit_code(self, mpirun_rc: int = ExitCode.FAILED) -> int:
        if self.signum is not None:
            return signal_exit_code(self.signum)
        return self.code if self.code else (mpirun_rc or ExitCode.FAILED)


@dataclass(frozen=True, kw_only=True)
class JobResult:
    """How a job ended, built once by the supervisor (``launcher.job.supervisor``) and never
    changed: a caller that must say more (a note, srun's exit code) makes a new one with
    ``dataclasses.replace``.

    Why dtrun stopped the job is one record, ``stops``: every stop request in the order they
    came (the first is the stop). ``interrupted``, ``signum``, ``timeout``, ``hung``,
    ``stopped`` and ``stdout_closed`` are read from it.
    """

    returncode: int  # dtrun's exit code
    mpirun_returncode: int
    failures: tuple[RankFailure, ...] = ()
    stops: tuple[StopState, ...] = ()  # every request to stop the job, in order (none: it ended by itself)
    lost_daemon_host: Optional[str] = None  # Open MPI lost its daemon on this host
    vanished: tuple[tuple[str, str], ...] = ()  # (rank, host) started, then never heard of again
    notes: tuple[str, ...] = ()  # warnings for the end of the run
    forced: bool = False  # mpirun did not stop in time: its session on this host was killed
    pmix_refused: Optional[str] = None  # where PMIx 5.0 refused to start (a stale session dir: launcher/remote/sessiondirs.py)
    launcher: str = "mpirun"  # the program that ran the job, as messages name it (srun, mpiexec.hydra, mpirun)
    launcher_pid: Optional[int] = None  # the launcher's pid (Open MPI 5 names its PMIx namespace after it)

    def __post_init__(self) -> None:
        for name in ("failures", "stops", "vanished", "notes"):  # callers may hand lists
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def stop(self) -> Optional[StopState]:
        """Why dtrun stopped the job (the first request), or None: it ended by itself."""
        return self.stops[0] if self.stops else None

    @property
    def stop_reason(self) -> Optional[StopReason]:
        return self.stop.reason if self.stop is not None else None

    @property
    def stopped(self) -> bool:
        """dtrun stopped the job (a signal, a time limit, a failed rank, --on-hang, stdout closed)."""
        return bool(self.stops)

    @property
    def hung(self) -> bool:
        """--on-hang abort or restart stopped the job (launcher/hangwatch.py)."""
        return self.stop_reason is StopReason.HANG

    def _requested(self, reason: StopReason) -> Optional[StopState]:
        """The first request for ``reason``, also after another cause stopped the job; none
        after a hang stop, which is what the end of the job reports whatever came after it."""
        if self.hung:
            return None
        return next((s for s in self.stops if s.reason is reason), None)

    @property
    def signum(self) -> Optional[int]:
        """The first terminating signal that reached dtrun while the job ran."""
        state = self._requested(StopReason.SIGNAL)
        return state.signum if state is not None else None

    @property
    def interrupted(self) -> bool:
        """A signal stopped dtrun: its exit code is the signal's, and no restart follows."""
        return self.signum is not None

    @property
    def timeout(self) -> Optional[str]:
        """Why a time limit stopped the job (--timeout or --start-timeout, a sentence), or None."""
        if self.stop_reason in (StopReason.TIMEOUT, StopReason.START_TIMEOUT):
            return self.stop.detail
        return None

    @property
    def stdout_closed(self) -> bool:
        """dtrun's stdout went away (| head): the job was stopped."""
        return self._requested(StopReason.STDOUT_CLOSED) is not None

    @property
    def unexplained(self) -> bool:
        """The launcher failed and nothing dtrun saw explains it: no rank failed, nothing stopped
        the job (a signal, a time limit, --on-hang, stdout closed), no daemon was lost and no
        rank went silent."""
        return (self.returncode != 0 and not self.failures and not self.interrupted and not self.timeout
                and not self.hung and not self.stdout_closed and not self.vanished and not self.lost_daemon_host)


def launcher_name(argv: Sequence[str]) -> str:
    """The launcher as users know it: the name it was run by (srun, mpirun, mpiexec.hydra), also
    after ``env NAME=VALUE ...`` (how dtrun hands srun values that its --export cannot carry)."""
    args = list(argv)
    if args and os.path.basename(args[0]) == "env":
        args = args[1:]
        while args and "=" in args[0] and not args[0].startswith("-"):
            args = args[1:]
    return os.path.basename(args[0]) if args else "mpirun"


def expected_hosts(hosts: Sequence, np: int) -> list[str]:
    """Host name of each rank when slots are filled in order (``--map-by slot``, Hydra's ``-hosts``)."""
    order = [h.host for h in hosts for _ in range(max(int(h.slots), 1))]
    if not order:
        return []
    return [order[r % len(order)] for r in range(np)]


def order_failures(failures: Sequence[RankFailure], reported_rank: Optional[str] = None) -> list[RankFailure]:
    """Put the root cause first.

    Output from different hosts arrives in any order, so arrival order is not failure
    order. First a rank killed by a signal the launcher did not send (``kill -9``, the
    OOM killer, SIGSEGV): the others' errors follow from it; then ranks that exited with
    a code, the earliest first (a rank that exits makes its peers fail a moment later
    with errors of their own, and Open MPI may report one of those first); the rank
    Open MPI reports breaks ties; last, ranks killed while the job was torn down.
    """
    def key(item):
        i, f = item
        category = 2 if f.torn_down else (0 if f.signum is not None else 1)
        when = f.time if f.time is not None else float("inf")
        reported = 0 if reported_rank is not None and f.rank == reported_rank else 1
        return (category, when, reported, i)

    return [f for _, f in sorted(enumerate(failures), key=key)]


def root_cause(failures: Sequence[RankFailure]) -> Optional[RankFailure]:
    """The first failure that is not a consequence of the job being torn down."""
    return next((f for f in failures if not f.torn_down), None)


def exit_code_for(mpirun_rc: int, failures: Sequence[RankFailure], interrupted: bool,
                  signum: int = signal.SIGINT) -> int:
    """dtrun's exit code: 130 on Ctrl-C (128+N for another signal N that stopped dtrun);
    otherwise the failing rank's own code (the same under every MPI); never 0 for a job
    killed by a signal."""
    if interrupted:
        return ExitCode.INTERRUPTED if signum == signal.SIGINT else signal_exit_code(signum)
    cause = root_cause(failures)
    if cause is not None:
        return cause.exit_code(mpirun_rc)
    if mpirun_rc < 0:
        return signal_exit_code(-mpirun_rc)
    if mpirun_rc == 0:
        for f in failures:
            return f.exit_code()
    return mpirun_rc
