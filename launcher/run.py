"""Running mpirun as a child: signals, the exit code, and the failure summary.

mpirun runs in its own process group with the argument list (no shell). dtrun
forwards SIGINT/SIGTERM once (a terminal's Ctrl-C reaching both would make Open
MPI skip its clean-up), escalates to SIGTERM and SIGKILL of the group if mpirun
does not stop, and reads mpirun's stderr to find the rank wrapper's exit markers.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

from launcher.errors import ExitCode, LaunchError, signal_exit_code, signal_name
from launcher.rankexec import MARKER

_MARKER_RE = re.compile(re.escape(MARKER) + r" rank=(\S+) host=(\S+) (code|signal)=(-?\d+)"
                        r"(?: start-error=([^;]*); program=(.*))?")
# Open MPI's own report when no marker was seen (e.g. the program is not wrapped).
_OMPI_RANK_RE = re.compile(r"Process name:\s+\[[^\]]*?,(\d+)\]")
_OMPI_CODE_RE = re.compile(r"Exit code:\s+(\d+)")
_OMPI_SIGNAL_RE = re.compile(r"exited on signal (\d+)")
_OMPI_ABORT_RE = re.compile(r"process rank (\d+) with PID \d+ on node (\S+)")
# Signals mpirun sends to the other ranks while it tears a failed job down.
_TEARDOWN_SIGNALS = {signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGHUP}
# Grace periods for a Ctrl-C: mpirun gets this long to stop its ranks before SIGTERM, then SIGKILL.
INTERRUPT_GRACE_S = 5.0
TERM_GRACE_S = 3.0


@dataclass
class RankFailure:
    rank: str
    host: str
    code: Optional[int] = None
    signum: Optional[int] = None
    start_error: Optional[str] = None  # the rank wrapper could not start the program ("command not found")
    program: Optional[str] = None

    @property
    def how(self) -> str:
        if self.start_error:
            return f"could not start {self.program}: {self.start_error}"
        if self.signum is not None:
            return f"killed by {signal_name(self.signum)}"
        if self.code is None:
            return "aborted the job"
        return f"exited with code {self.code}"


@dataclass
class JobResult:
    returncode: int  # dtrun's exit code
    mpirun_returncode: int
    failures: list = field(default_factory=list)
    interrupted: bool = False
    hung: bool = False  # --on-hang abort stopped the job (launcher/hangwatch.py)


def parse_marker(line: str) -> Optional[RankFailure]:
    m = _MARKER_RE.search(line)
    if not m:
        return None
    rank, host, kind, value, start_error, program = m.groups()
    if kind == "signal":
        return RankFailure(rank, host, signum=int(value))
    return RankFailure(rank, host, code=int(value), start_error=start_error, program=(program or "").rstrip() or None)


def order_failures(failures: Sequence[RankFailure], reported_rank: Optional[str] = None) -> list[RankFailure]:
    """Put the root cause first.

    Output from different hosts arrives in any order, so arrival order is not failure
    order: the rank Open MPI reports first wins; then ranks that exited with a code or
    died of a signal of their own (SIGSEGV, ...) before ranks mpirun killed while
    tearing the job down.
    """
    def key(item):
        i, f = item
        if reported_rank is not None and f.rank == reported_rank:
            return (0, i)
        torn_down = f.signum is not None and f.signum in _TEARDOWN_SIGNALS
        return (2 if torn_down else 1, i)

    return [f for _, f in sorted(enumerate(failures), key=key)]


def exit_code_for(mpirun_rc: int, failures: Sequence[RankFailure], interrupted: bool,
                  signum: int = signal.SIGINT) -> int:
    """dtrun's exit code: 130 on Ctrl-C (128+N for another signal N that stopped dtrun);
    otherwise the job's code; never 0 for a job killed by a signal."""
    if interrupted:
        return ExitCode.INTERRUPTED if signum == signal.SIGINT else signal_exit_code(signum)
    if mpirun_rc < 0:
        return signal_exit_code(-mpirun_rc)
    if mpirun_rc == 0:
        for f in failures:
            if f.signum is not None:
                return signal_exit_code(f.signum)
            if f.code:
                return f.code
    return mpirun_rc


class _StderrPump(threading.Thread):
    """Copies mpirun's stderr to ours, keeping marker lines back and remembering Open MPI's report."""

    def __init__(self, stream, on_line=None):
        super().__init__(daemon=True)
        self.stream = stream
        self.on_line = on_line
        self.failures: list[RankFailure] = []
        self.ompi_report: list[str] = []

    def run(self):
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        for raw in iter(self.stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            failure = parse_marker(line)
            if failure is not None:
                self.failures.append(failure)
                continue
            if ("Process name:" in line or "Exit code:" in line or "exited on signal" in line
                    or "process rank" in line):
                self.ompi_report.append(line)
            if self.on_line is not None:
                self.on_line(line)
            if out is not None:
                out.write(raw)
                out.flush()
            else:
                sys.stderr.write(line)

    def reported_rank(self) -> Optional[str]:
        """The rank Open MPI names as the first to fail, if it said."""
        text = "".join(self.ompi_report)
        m = _OMPI_RANK_RE.search(text) or _OMPI_ABORT_RE.search(text)
        return m.group(1) if m else None

    def fallback_failure(self) -> Optional[RankFailure]:
        text = "".join(self.ompi_report)
        rank = _OMPI_RANK_RE.search(text)
        if not rank:
            abort = _OMPI_ABORT_RE.search(text)
            return RankFailure(abort.group(1), abort.group(2), code=None) if abort else None
        code = _OMPI_CODE_RE.search(text)
        sig = _OMPI_SIGNAL_RE.search(text)
        return RankFailure(rank.group(1), "?", code=int(code.group(1)) if code else None,
                           signum=int(sig.group(1)) if sig else None)


def _relay(stream, on_line) -> None:
    """Copy mpirun's stdout to ours line by line, telling the hang monitor of each line."""
    out = sys.stdout.buffer
    for raw in iter(stream.readline, b""):
        on_line(raw)
        out.write(raw)
        out.flush()


def run_job(argv: Sequence[str], env: Optional[dict] = None, monitor=None) -> JobResult:
    """Run mpirun with ``argv`` and wait, handling Ctrl-C / SIGTERM. Never uses a shell.

    ``monitor`` (launcher/hangwatch.Monitor): SIGQUIT prints every rank's stack and the
    job goes on; with --hang-timeout it watches progress and may stop the job.
    """
    # mpirun is in its own process group, so reading a terminal would stop it (SIGTTIN).
    stdin = subprocess.DEVNULL if sys.stdin is None or sys.stdin.isatty() else None
    relay = monitor is not None and monitor.wants_output
    try:
        proc = subprocess.Popen(list(argv), stdin=stdin, stderr=subprocess.PIPE, env=env, start_new_session=True,
                                stdout=subprocess.PIPE if relay else None)
    except OSError as exc:
        raise LaunchError(f"cannot start {argv[0]}: {exc.strerror}") from None
    pump = _StderrPump(proc.stderr, monitor.saw_output if monitor is not None else None)
    pump.start()
    if relay:
        out_pump = threading.Thread(target=_relay, args=(proc.stdout, monitor.saw_output), daemon=True)
        out_pump.start()

    state = {"stage": 0}  # "signum": the first signal that interrupted dtrun
    lock = threading.Lock()

    def escalate():
        """First call: forward SIGINT; then SIGTERM; then SIGKILL the whole group."""
        with lock:
            stage = state["stage"]
            state["stage"] += 1
        try:
            if stage == 0:
                proc.send_signal(signal.SIGINT)
            elif stage == 1:
                proc.send_signal(signal.SIGTERM)
            else:
                _kill_group(proc.pid)
        except (ProcessLookupError, PermissionError):
            pass

    def escalate_later(delay: float) -> None:
        """If mpirun is still running after ``delay``, take the next step (SIGTERM, then SIGKILL)."""
        def step():
            if proc.poll() is None:
                escalate()
                if state["stage"] < 3:
                    escalate_later(TERM_GRACE_S)
        t = threading.Timer(delay, step)
        t.daemon = True
        t.start()

    def on_signal(signum, _frame):
        first = "signum" not in state
        state.setdefault("signum", signum)
        escalate()
        if first:
            escalate_later(INTERRUPT_GRACE_S)

    def on_hang_abort():
        state["hang"] = True
        escalate()
        escalate_later(INTERRUPT_GRACE_S)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    if monitor is not None:
        # SIGQUIT (Ctrl-\\) is a stack dump of every rank here, like a Java thread dump:
        # the job is NOT stopped. Stop it with Ctrl-C or SIGTERM.
        old[signal.SIGQUIT] = signal.signal(signal.SIGQUIT, lambda _s, _f: monitor.request_dump("SIGQUIT"))
        monitor.start(abort=on_hang_abort)
    try:
        proc.wait()  # signals interrupt the wait, run on_signal, and the wait resumes (PEP 475)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if monitor is not None:
            monitor.stop()
    pump.join(timeout=5)
    if relay:
        out_pump.join(timeout=5)
    if state.get("hang"):
        _kill_group(proc.pid)
        return JobResult(ExitCode.HANG, proc.returncode, [], False, hung=True)
    interrupted = "signum" in state
    if interrupted:
        _kill_group(proc.pid)  # nothing of the job's process group stays behind on this host
    failures = order_failures(pump.failures, pump.reported_rank())
    if not failures and proc.returncode != 0 and not interrupted:
        fb = pump.fallback_failure()
        if fb:
            failures.append(fb)
    rc = exit_code_for(proc.returncode, failures, interrupted, state.get("signum", signal.SIGINT))
    return JobResult(rc, proc.returncode, failures, interrupted)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def failure_summary(result: JobResult, log_dir: Optional[str] = None) -> str:
    """One summary line and a short table like torchrun's, for a failed job."""
    if result.interrupted:
        return "dtrun: interrupted; the job was stopped"
    if result.hung:
        return f"dtrun: the job made no progress and was stopped (--on-hang abort; exit code {int(ExitCode.HANG)})"
    if not result.failures:
        return f"dtrun: job failed: mpirun exited with code {result.mpirun_returncode}"
    first = result.failures[0]
    others = len({f.rank for f in result.failures}) - 1
    tail = f" ({others} other rank{'s' if others != 1 else ''} stopped too)" if others > 0 else ""
    head = f"rank {first.rank} on {first.host} {first.how}"
    if first.start_error:  # say it the way a shell would: "PROGRAM: command not found on HOST"
        head = f"{first.program}: {first.start_error} on {first.host} (rank {first.rank})"
    lines = [f"dtrun: job failed: {head}{tail}",
             "  first failure:",
             f"    rank       : {first.rank}",
             f"    host       : {first.host}",
             f"    {'signal' if first.signum is not None else 'exit code':<11}: "
             f"{signal_name(first.signum) + f' ({first.signum})' if first.signum is not None else first.code}"]
    if log_dir:
        lines.append(f"    log        : {os.path.join(log_dir, f'rank.{first.rank}.log')}")
    return "\n".join(lines)
