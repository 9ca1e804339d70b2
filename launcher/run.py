"""Running mpirun as a child: output, signals, time limits, the exit code and the failure summary.

mpirun runs in its own session with the argument list (no shell). dtrun

* pumps mpirun's stdout and stderr through itself (one place, ``_Pumps``): stdout is
  read as fast as mpirun writes it and buffered here, because Open MPI drops a remote
  rank's pending output when the job ends while its stdout is a slow pipe; stderr is
  read line by line to pick out the rank wrapper's start and exit markers;
* stops the job on every catchable terminating signal (``STOP_SIGNALS``): SIGINT is
  forwarded to mpirun once (a terminal's Ctrl-C reaching both would make Open MPI skip
  its clean-up), and whatever of mpirun's session is still alive ``STOP_GRACE_S`` later
  is killed, so dtrun exits within a few seconds whatever the network does and leaves
  no process behind on this host (ssh clients included);
* stops the job when a rank fails and mpirun does not end it by itself (MPICH's Hydra
  keeps the other ranks running), when ``timeout`` passes, and when ranks have not
  started within ``start_timeout`` (naming the hosts they were meant for).

Other parts of dtrun follow a job through ``JobObserver`` (output, markers, signals).
"""
from __future__ import annotations

import collections
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from launcher.errors import ExitCode, LaunchError, signal_exit_code, signal_name
from launcher.rankexec import EOF_MARKER, MARKER, MARKER_TOKEN_ENV, START_MARKER, marker_head

# A launcher's rank tag before a line: Open MPI's "[1,0]<stdout>: ", Hydra's "[0] ".
_TAG_MAX = 128
_TAG = r"(?:\[[^\]\n]{0,%d}\](?:<stdout>)?:? ?)?" % _TAG_MAX
# Digits a marker's rank may have: a longer run is not a marker, so it is never held back.
_RANK_DIGITS = 10
# Open MPI's own report when no marker was seen (e.g. the program is not wrapped).
_OMPI_RANK_RE = re.compile(r"Process name:\s+\[[^\]]*?,(\d+)\]")
_OMPI_CODE_RE = re.compile(r"Exit code:\s+(\d+)")
_OMPI_SIGNAL_RE = re.compile(r"exited on signal (\d+)")
_OMPI_ABORT_RE = re.compile(r"process rank (\d+) with PID \d+ on node (\S+)")
# MPICH's MPI_Abort report (Hydra kills the wrappers before they can print a marker).
_MPICH_ABORT_RE = re.compile(r"Abort\((\d+)\) on node \d+ \(rank (\d+) in comm \d+\)")
# Open MPI 5 (PRRTE) and 4 (ORTE) when a daemon on another host dies or its connection drops:
# "PRTE has lost communication with a remote daemon. ... Remote daemon: [...] on node h2".
_DAEMON_LOST_RE = re.compile(r"Remote daemon\s*:\s*\[.*?\]\s+on node\s+(\S+)")
# Signals mpirun sends to the other ranks while it tears a failed job down (for markers
# from wrappers that do not say whether they forwarded the signal).
_TEARDOWN_SIGNALS = {signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGHUP}
# Every signal that terminates a process by default and can be caught: each stops the job.
STOP_SIGNALS = tuple(s for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1,
                                 signal.SIGUSR2, signal.SIGALRM, getattr(signal, "SIGVTALRM", None),
                                 getattr(signal, "SIGPROF", None), getattr(signal, "SIGXCPU", None),
                                 getattr(signal, "SIGXFSZ", None), getattr(signal, "SIGPWR", None),
                                 getattr(signal, "SIGIO", None)) if s is not None)
# mpirun gets this long after SIGINT to stop its ranks; then its whole session is killed.
STOP_GRACE_S = 4.0
# After a rank's failure marker, mpirun gets this long to end the job by itself (Open MPI
# does in about 2 s); then dtrun stops it (MPICH's Hydra lets the other ranks run on).
FAILURE_GRACE_S = 3.0
# Buffered stdout beyond which reading from mpirun pauses (and output may be dropped by it).
STDOUT_BUFFER_MAX = 256 << 20
SIGPIPE_EXIT = 128 + 13


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
        return self.signum in _TEARDOWN_SIGNALS

    def exit_code(self, mpirun_rc: int = ExitCode.FAILED) -> int:
        if self.signum is not None:
            return signal_exit_code(self.signum)
        return self.code if self.code else (mpirun_rc or ExitCode.FAILED)


@dataclass
class JobResult:
    returncode: int  # dtrun's exit code
    mpirun_returncode: int
    failures: list = field(default_factory=list)
    interrupted: bool = False
    signum: Optional[int] = None  # the signal that stopped dtrun
    timeout: Optional[str] = None  # why a time limit stopped the job (a sentence)
    stdout_closed: bool = False  # dtrun's stdout went away (| head): the job was stopped
    lost_daemon_host: Optional[str] = None  # Open MPI lost its daemon on this host
    vanished: list = field(default_factory=list)  # (rank, host) started, then never heard of again
    notes: list = field(default_factory=list)  # warnings for the end of the run
    hung: bool = False  # --on-hang abort stopped the job (launcher/hangwatch.py)
    forced: bool = False  # mpirun did not stop in time: its session on this host was killed
    stopped: bool = False  # dtrun stopped the job (a signal, a time limit, a failed rank, --on-hang abort)
    pmix_refused: Optional[str] = None  # where PMIx 5.0 refused to start (a stale session dir: launcher/sessiondirs.py)
    launcher: str = "mpirun"  # the program that ran the job, as messages name it (srun, mpiexec.hydra, mpirun)

    @property
    def how_stopped(self) -> str:
        if self.forced:
            return (f"{self.launcher} did not stop within {STOP_GRACE_S:g} s, so it and everything it started on this "
                    f"host were killed; a host that cannot be reached keeps its ranks until its connections time out")
        return f"{self.launcher} stopped the job on every host"

    @property
    def launcher_ended(self) -> str:
        """How the launcher itself ended: "srun exited with code 137"."""
        if self.mpirun_returncode < 0:
            return f"{self.launcher} was killed by {signal_name(-self.mpirun_returncode)}"
        return f"{self.launcher} exited with code {self.mpirun_returncode}"


def launcher_name(argv: Sequence[str]) -> str:
    """The launcher as users know it: the name it was run by (srun, mpirun, mpiexec.hydra), also
    after ``env NAME=VALUE ...`` (how dtrun hands srun values that its --export cannot carry)."""
    args = list(argv)
    if args and os.path.basename(args[0]) == "env":
        args = args[1:]
        while args and "=" in args[0] and not args[0].startswith("-"):
            args = args[1:]
    return os.path.basename(args[0]) if args else "mpirun"


class JobObserver:
    """Hooks into a running job; every method is optional and runs on dtrun's threads.

    ``on_signal`` returns True when it handled the signal itself (the job is then not stopped).
    """

    def on_start(self, job: "RunningJob") -> None:
        pass

    def on_output(self, stream: str, data: bytes) -> None:
        """Every chunk of the job's ``stdout`` or line of ``stderr`` (markers excluded)."""

    def on_rank_start(self, rank: str, host: str) -> None:
        pass

    def on_rank_exit(self, failure: RankFailure) -> None:
        pass

    def on_signal(self, signum: int) -> bool:
        return False

    def on_end(self, result: JobResult) -> None:
        pass


@dataclass(frozen=True)
class MarkerPatterns:
    """The wrapper's markers for one job's token (launcher/rankexec.py): a line that has a
    marker's text but not this token is the program's own output and passes through."""

    token: str
    exit: re.Pattern
    start: re.Pattern
    eof_line: re.Pattern  # the wrapper's last stdout line, alone (after a rank tag)
    eof_glued: re.Pattern  # ... or after a last line of the program's that had no newline
    eof_head: str  # the end-of-output marker up to its rank number


@functools.lru_cache(maxsize=8)
def marker_patterns(token: str = "") -> MarkerPatterns:
    """The patterns for ``token`` ("": the wrapper ran without one, outside dtrun)."""
    exit_head, eof_head = marker_head(MARKER, token), marker_head(EOF_MARKER, token) + " rank="
    return MarkerPatterns(
        token,
        re.compile(re.escape(exit_head) + r" rank=(\S+) host=(\S+) (code|signal)=(-?\d+)(?: forwarded=([01]))?"
                   r"(?: t=(\d+(?:\.\d+)?))?(?: start-error=([^;]*); program=(.*))?"),
        re.compile(re.escape(marker_head(START_MARKER, token)) + r" rank=(\S+) host=(\S+)"),
        re.compile(r"(?m)^" + _TAG + re.escape(eof_head) + r"(\d+)\n"),
        re.compile(re.escape(eof_head) + r"(\d+)(?=\n)"),
        eof_head)


ENV_END = "DTRUN_ENV_END"  # the last variable of mpirun's environment (see run_job)


def new_marker_token() -> str:
    """A job's marker token: random, so no program can print a marker by chance or by copying."""
    import secrets

    return secrets.token_hex(8)


def parse_marker(line: str, token: str = "") -> Optional[RankFailure]:
    m = marker_patterns(token).exit.search(line)
    if not m:
        return None
    rank, host, kind, value, fwd, when, start_error, program = m.groups()
    forwarded = None if fwd is None else fwd == "1"
    when = float(when) if when else None
    if kind == "signal":
        return RankFailure(rank, host, signum=int(value), forwarded=forwarded, time=when)
    return RankFailure(rank, host, code=int(value), time=when, start_error=start_error,
                       program=(program or "").rstrip() or None)


def parse_start_marker(line: str, token: str = "") -> Optional[tuple[str, str]]:
    m = marker_patterns(token).start.search(line)
    return (m.group(1), m.group(2)) if m else None


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


def expected_hosts(hosts: Sequence, np: int) -> list[str]:
    """Host name of each rank when slots are filled in order (``--map-by slot``, Hydra's ``-hosts``)."""
    order = [h.host for h in hosts for _ in range(max(int(h.slots), 1))]
    if not order:
        return []
    return [order[r % len(order)] for r in range(np)]


# What is printed when PMIx 5.0 will not start because a stale session directory holds its
# rendezvous file's name (launcher/sessiondirs.py): mpirun's own refusal on stderr; for a
# remote daemon, only mpirun's report of its exit status 213 (on stdout).
PMIX_LISTENER_FAILED = "PMIx server's listener thread failed to start"
_DAEMON_213_RE = re.compile(r"Remote host:\s+(\S+)\s*\n\s*Daemon exit status:\s*213\b")
PMIX_SCAN_BYTES = 64 << 10


def pmix_refusal(text: str) -> Optional[str]:
    """Where PMIx refused to start, from mpirun's output: the remote host, "this machine", or None."""
    m = _DAEMON_213_RE.search(text)
    if m:
        return m.group(1)
    return "this machine" if PMIX_LISTENER_FAILED in text else None


class _Pumps:
    """mpirun's stdout and stderr, copied to dtrun's own: the one place output flows through."""

    def __init__(self, proc, observers, on_marker, on_start_marker, on_stdout_closed, token: str = ""):
        self.proc = proc
        self.token = token  # the job's marker token (rankexec.MARKER_TOKEN_ENV)
        self.observers = observers
        self.on_marker, self.on_start_marker, self.on_stdout_closed = on_marker, on_start_marker, on_stdout_closed
        self.ompi_report: list[str] = []
        self.stderr_tail: collections.deque = collections.deque(maxlen=200)
        self.eof_ranks: set = set()  # ranks whose end-of-output marker arrived
        self.stdout_head: list[str] = []  # the first PMIX_SCAN_BYTES (mpirun's reports about daemons)
        self._stdout_seen = 0
        self._chunks: collections.deque = collections.deque()
        self._buffered = 0
        self.throttled = False
        self._cond = threading.Condition()
        self._eof = False
        self.threads = [threading.Thread(target=self._read_stdout, daemon=True),
                        threading.Thread(target=self._write_stdout, daemon=True),
                        threading.Thread(target=self._read_stderr, daemon=True)]

    def start(self):
        for t in self.threads:
            t.start()

    def join(self, timeout: float, drain: bool) -> None:
        """Wait for the readers (at most ``timeout``), then for all of stdout to be written
        out (without a limit when ``drain``: output is not dropped because a reader is slow)."""
        deadline = time.monotonic() + timeout
        for t in (self.threads[0], self.threads[2]):
            t.join(max(0.0, deadline - time.monotonic()))
        self.threads[1].join(None if drain else max(1.0, deadline - time.monotonic()))

    def _notify(self, stream, data):
        for o in self.observers:
            o.on_output(stream, data)

    def _read_stdout(self):
        fd = self.proc.stdout.fileno()
        held = ""
        line_start = True  # what was passed on so far ended with a newline
        try:
            while True:
                raw = os.read(fd, 1 << 16)
                if not raw:
                    break
                text, held = split_eof_markers(held + raw.decode("utf-8", "surrogateescape"), self.eof_ranks,
                                               self.token, line_start)
                data = text.encode("utf-8", "surrogateescape")
                if not data:
                    continue
                line_start = text.endswith("\n")
                if self._stdout_seen < PMIX_SCAN_BYTES:  # they come before any rank's output
                    self._stdout_seen += len(data)
                    self.stdout_head.append(text)
                self._notify("stdout", data)
                with self._cond:
                    while self._buffered > STDOUT_BUFFER_MAX and not self._eof:
                        self.throttled = True
                        self._cond.wait(0.5)
                    self._chunks.append(data)
                    self._buffered += len(data)
                    self._cond.notify_all()
            if held:
                self._put(held.encode("utf-8", "surrogateescape"))
        except OSError:
            pass
        finally:
            with self._cond:
                self._eof = True
                self._cond.notify_all()

    def _put(self, data: bytes) -> None:
        with self._cond:
            self._chunks.append(data)
            self._buffered += len(data)
            self._cond.notify_all()

    def _write_stdout(self):
        out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
        broken = False
        while True:
            with self._cond:
                while not self._chunks and not self._eof:
                    self._cond.wait()
                if not self._chunks:
                    return
                data = b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                self._cond.notify_all()
            if broken:
                continue  # keep reading so mpirun is never blocked while the job stops
            try:
                if out is not None:
                    out.write(data)
                    out.flush()
                else:
                    sys.stdout.write(data.decode("utf-8", "replace"))
                    sys.stdout.flush()
            except (BrokenPipeError, OSError, ValueError):
                broken = True
                self.on_stdout_closed()

    def _read_stderr(self):
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace")
            started = parse_start_marker(line, self.token)
            if started is not None:
                self.on_start_marker(*started)
                continue
            failure = parse_marker(line, self.token)
            if failure is not None:
                self.on_marker(failure)
                continue
            self.stderr_tail.append(line)
            if ("Process name:" in line or "Exit code:" in line or "exited on signal" in line
                    or "process rank" in line or "Abort(" in line):
                self.ompi_report.append(line)
            self._notify("stderr", raw)
            try:
                if out is not None:
                    out.write(raw)
                    out.flush()
                else:
                    sys.stderr.write(line)
            except (OSError, ValueError):
                pass

    def reported_rank(self) -> Optional[str]:
        """The rank Open MPI names as the first to fail, if it said."""
        text = "".join(self.ompi_report)
        m = _OMPI_RANK_RE.search(text) or _OMPI_ABORT_RE.search(text)
        return m.group(1) if m else None

    def fallback_failure(self) -> Optional[RankFailure]:
        text = "".join(self.ompi_report)
        mpich = _MPICH_ABORT_RE.search(text)
        if mpich:
            code = int(mpich.group(1))  # MPI_Abort's code, or an MPI error code for an internal failure
            return RankFailure(mpich.group(2), "?", code=code if 0 < code < 256 else None)
        rank = _OMPI_RANK_RE.search(text)
        if not rank:
            abort = _OMPI_ABORT_RE.search(text)
            return RankFailure(abort.group(1), abort.group(2), code=None) if abort else None
        code = _OMPI_CODE_RE.search(text)
        sig = _OMPI_SIGNAL_RE.search(text)
        return RankFailure(rank.group(1), "?", code=int(code.group(1)) if code else None,
                           signum=int(sig.group(1)) if sig else None)


def split_eof_markers(text: str, seen: set, token: str = "", line_start: bool = True) -> tuple[str, str]:
    """Remove the wrappers' end-of-output markers from ``text`` (adding their ranks to ``seen``).

    ``line_start``: whether ``text`` begins a line (False when the output passed on so far
    ended without a newline: a marker at the start of ``text`` is then glued to that line,
    whose newline stays).

    Returns the text to pass on and a tail to hold back until more arrives: the end of an
    unfinished last line that could still become a marker (anything else, a prompt or a
    progress bar, goes out at once). The tail is never longer than a rank tag and a marker,
    so a long line without a newline is read once, chunk by chunk, however long it grows.
    """
    pat = marker_patterns(token)
    if pat.eof_head in text:
        def drop(m):
            seen.add(m.group(1))
            return ""

        start = 0 if line_start else text.find("\n") + 1 or len(text)
        text = pat.eof_glued.sub(drop, text[:start]) + pat.eof_glued.sub(drop, pat.eof_line.sub(drop, text[start:]))
    cut = text.rfind("\n") + 1
    hold = _marker_tail(text, cut, pat.eof_head, line_start or cut > 0)
    return text[:hold], text[hold:]


# What may follow a rank tag's "[...]" before the line itself (Open MPI 5: "<stdout>: ").
_TAG_TAILS = ("<stdout>: ", "<stdout>:", "<stdout> ", "<stdout>", ": ", ":", " ", "")


def _marker_tail(text: str, cut: int, head: str, line_start: bool) -> int:
    """Where the part of the last line (from ``cut``) that may still become a marker starts."""
    longest = len(head) + _RANK_DIGITS
    if line_start and text.startswith("[", cut) and len(text) - cut <= longest + _TAG_MAX + 12:
        # a rank tag, whole or in part, maybe with a marker to follow
        close = text.find("]", cut)
        if close == -1:
            return cut
        rest = text[close + 1:]
        if any(t.startswith(rest) or (rest.startswith(t) and _may_become(rest[len(t):], head)) for t in _TAG_TAILS):
            return cut
    # a marker alone, or glued to a last line that had no newline: only the end can be one
    i = text.find(head[0], max(cut, len(text) - longest))
    while i != -1:
        if _may_become(text[i:], head):
            return i
        i = text.find(head[0], i + 1)
    return len(text)


def _may_become(s: str, head: str) -> bool:
    """Whether ``s`` is the start of ``head`` followed by a rank number (without its newline yet)."""
    if len(s) <= len(head):
        return head.startswith(s)
    return s.startswith(head) and len(s) - len(head) <= _RANK_DIGITS and s[len(head):].isdigit()


def lost_daemon_host(stderr_text: str) -> Optional[str]:
    """The host whose MPI daemon Open MPI says it lost, if it said."""
    hosts = _DAEMON_LOST_RE.findall(stderr_text)
    return hosts[0] if hosts else None


class RunningJob:
    """The job while it runs: what observers may look at, and ``stop``."""

    def __init__(self, proc):
        self.proc = proc
        self.pid = proc.pid
        self.started_ranks: dict[str, str] = {}
        self.failures: list[RankFailure] = []
        self._lock = threading.Lock()
        self._stop_reason: Optional[str] = None
        self._stop_signals = 0
        self.wake = threading.Event()

    def stop(self, reason: str) -> None:
        """Ask for the job to be stopped (from any thread): SIGINT to mpirun, then kill its session."""
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = reason
            self._stop_signals += 1
        self.wake.set()

    @property
    def stop_reason(self) -> Optional[str]:
        return self._stop_reason


def run_job(argv: Sequence[str], env: Optional[dict] = None, *, timeout: Optional[float] = None,
            start_timeout: Optional[float] = None, expected: Sequence[str] = (),
            observers: Sequence[JobObserver] = (), failure_grace: float = FAILURE_GRACE_S,
            monitor=None) -> JobResult:
    """Run mpirun with ``argv`` and wait, handling signals and time limits. Never uses a shell.

    Args:
        timeout: seconds the whole job may take (None: no limit).
        start_timeout: seconds until every rank's wrapper must have said it started (None: no limit).
        expected: host name of each rank, to name the hosts whose ranks did not start.
        observers: hooks that follow the job (see JobObserver).
        failure_grace: seconds mpirun gets to end the job after a rank failed before dtrun stops it.
        monitor: the hang monitor (launcher/hangwatch.Monitor), one more observer: SIGQUIT prints
            every rank's stack and the job goes on; with --hang-timeout it may stop the job.
    """
    if monitor is not None:
        observers = tuple(observers) + (monitor,)
    stdin = subprocess.DEVNULL if sys.stdin is None or sys.stdin.isatty() else None
    # The rank wrappers read this job's marker token from their environment: mpirun forwards it
    # (-x / -genvlist, launcher/command.py), srun exports all of its own.
    token = new_marker_token()
    env = dict(os.environ if env is None else env)
    env[MARKER_TOKEN_ENV] = token
    # MPICH 4.0's Hydra drops the last variable of mpiexec's environment when it forwards
    # -genvlist names to hosts it reaches over ssh: keep a variable nobody forwards last.
    env.pop(ENV_END, None)
    env[ENV_END] = "1"
    try:
        proc = subprocess.Popen(list(argv), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                start_new_session=True)
    except OSError as exc:
        raise LaunchError(f"cannot start {argv[0]}: {exc.strerror}") from None
    _grow_pipe(proc.stdout)
    job = RunningJob(proc)
    state: dict = {}
    t0 = time.monotonic()

    def on_marker(failure: RankFailure):
        job.failures.append(failure)
        for o in observers:
            o.on_rank_exit(failure)
        if not failure.torn_down and "failed_at" not in state:
            state["failed_at"] = time.monotonic()
            job.wake.set()

    def on_start_marker(rank, host):
        job.started_ranks[rank] = host
        for o in observers:
            o.on_rank_start(rank, host)

    def on_stdout_closed():
        state["stdout_closed"] = True
        job.stop("stdout closed")

    pumps = _Pumps(proc, observers, on_marker, on_start_marker, on_stdout_closed, token)
    pumps.start()
    for o in observers:
        o.on_start(job)

    def on_signal(signum, _frame):
        if any(o.on_signal(signum) for o in observers):
            return
        state.setdefault("signum", signum)
        job.stop(f"signal {signum}")

    old = {}
    for s in STOP_SIGNALS:
        if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN:
            continue  # `nohup dtrun …`: a closed terminal must not stop the job
        try:
            old[s] = signal.signal(s, on_signal)
        except (OSError, ValueError):
            pass
    stopping_since = None
    sent = 0

    def reap():
        proc.wait()
        job.wake.set()

    # mpirun's end wakes the loop at once (no polling delay added to every job).
    threading.Thread(target=reap, daemon=True).start()
    try:
        while proc.returncode is None:
            job.wake.clear()
            now = time.monotonic()
            if timeout is not None and now - t0 > timeout and job.stop_reason is None:
                state["timeout"] = f"the job ran longer than --timeout {timeout:g} s"
                job.stop("timeout")
            if (start_timeout is not None and expected and now - t0 > start_timeout and job.stop_reason is None
                    and len(job.started_ranks) < len(expected)):
                state["timeout"] = not_started_message(expected, job.started_ranks, start_timeout)
                job.stop("start timeout")
            if "failed_at" in state and now - state["failed_at"] > failure_grace and job.stop_reason is None:
                job.stop("rank failed")
            wait = 1.0
            if job.stop_reason is not None:
                if stopping_since is None:
                    stopping_since = now
                # first request: SIGINT to mpirun; a repeated signal: SIGTERM; the grace over: kill all
                want = min(job._stop_signals, 2)
                while sent < want:
                    sent += 1
                    _signal(proc, signal.SIGINT if sent == 1 else signal.SIGTERM)
                if now - stopping_since > STOP_GRACE_S or job._stop_signals >= 3:
                    state["forced"] = True
                    kill_session(proc.pid)
                    break
                wait = STOP_GRACE_S - (now - stopping_since)
            else:
                if timeout is not None:
                    wait = min(wait, t0 + timeout - now)
                if start_timeout is not None and expected and len(job.started_ranks) < len(expected):
                    wait = min(wait, t0 + start_timeout - now)
                if "failed_at" in state:
                    wait = min(wait, state["failed_at"] + failure_grace - now)
            if proc.returncode is None:
                job.wake.wait(max(wait, 0.01))
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            state["forced"] = True
            kill_session(proc.pid)
            proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    # Nothing of mpirun's session stays behind on this host (ssh clients, prterun helpers),
    # also after a normal end: a daemon's ssh client may linger while its host is silent.
    kill_session(proc.pid)
    pumps.join(timeout=5, drain=job.stop_reason is None)
    result = _result(proc.returncode, job, pumps, state, expected)
    for o in observers:
        o.on_end(result)
    return result


def _result(mpirun_rc: int, job: RunningJob, pumps: _Pumps, state: dict, expected: Sequence[str]) -> JobResult:
    interrupted = "signum" in state
    launcher = launcher_name(job.proc.args)
    if (job.stop_reason or "").startswith("no progress"):  # the hang monitor's --on-hang abort
        return JobResult(ExitCode.HANG, mpirun_rc, [], False, hung=True, stopped=True, launcher=launcher)
    failures = order_failures(job.failures, pumps.reported_rank())
    if root_cause(failures) is None and mpirun_rc != 0 and not interrupted:
        fb = pumps.fallback_failure()
        if fb:
            if fb.host == "?" and fb.rank.isdigit() and int(fb.rank) < len(expected):
                fb.host = job.started_ranks.get(fb.rank) or expected[int(fb.rank)]
            failures.insert(0, fb)
    signum = state.get("signum")
    if interrupted:
        rc = exit_code_for(mpirun_rc, failures, True, signum)
    elif "timeout" in state:
        rc = ExitCode.TIMEOUT
    elif state.get("stdout_closed") and root_cause(failures) is None:
        rc = SIGPIPE_EXIT
    else:
        rc = exit_code_for(mpirun_rc, failures, False)
    stderr_tail = "".join(pumps.stderr_tail)
    lost = lost_daemon_host(stderr_tail) if root_cause(failures) is None else None
    if lost and rc == 0:
        rc = ExitCode.FAILED  # Open MPI 5 was seen to exit 0 after losing a daemon and its ranks
    result = JobResult(rc, mpirun_rc, failures, interrupted, signum, state.get("timeout"),
                       bool(state.get("stdout_closed")), lost, forced=bool(state.get("forced")),
                       stopped=job.stop_reason is not None,
                       pmix_refused=None if job.started_ranks else pmix_refusal(stderr_tail + "".join(pumps.stdout_head)),
                       launcher=launcher)
    if mpirun_rc != 0 and root_cause(failures) is None and not lost and not interrupted and "timeout" not in state:
        # Open MPI does not always say which daemon it lost: the ranks that started and then sent
        # neither an exit report nor their last output line went down with their host or daemon.
        heard = {f.rank for f in job.failures} | pumps.eof_ranks
        quiet = [(r, h) for r, h in sorted(job.started_ranks.items(), key=lambda t: (len(t[0]), t[0])) if r not in heard]
        if quiet and len(quiet) < len(job.started_ranks):
            result.vanished = quiet
    missing = output_cut_short(job, pumps.eof_ranks, mpirun_rc == 0 and job.stop_reason is None)
    if missing:
        where = ", ".join(f"rank {r} on {job.started_ranks.get(r, '?')}" for r in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        result.notes.append(f"the end of the output of {where}{more} did not arrive: Open MPI dropped it when the "
                            f"job ended (it can when a rank writes a lot just before it exits); --log-dir DIR "
                            f"keeps all of it")
    if pumps.throttled:
        result.notes.append(f"the job wrote output faster than dtrun's stdout took it and more than "
                            f"{STDOUT_BUFFER_MAX >> 20} MiB waited here; {launcher} may have dropped some of it: "
                            f"use --log-dir DIR for large output")
    return result


def output_cut_short(job: "RunningJob", eof_ranks: set, succeeded: bool) -> list[str]:
    """Ranks whose wrapper wrote its end-of-output line that never arrived.

    After a clean end every started rank wrote it; after a failure, every rank whose exit
    marker arrived did (it is written just before that marker).
    """
    if succeeded:
        wrote = set(job.started_ranks)
    else:
        wrote = {f.rank for f in job.failures}
    return sorted((r for r in wrote if r not in eof_ranks), key=lambda r: (len(r), r))


def not_started_message(expected: Sequence[str], started: dict, limit: float) -> str:
    missing = [r for r in range(len(expected)) if str(r) not in started]
    by_host: dict[str, list[int]] = {}
    for r in missing:
        by_host.setdefault(expected[r], []).append(r)
    parts = []
    for host, ranks in by_host.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{host} ({label} {','.join(map(str, ranks))})")
    return (f"{len(missing)} of {len(expected)} ranks had not started after --start-timeout {limit:g} s; "
            f"not up: {'; '.join(parts)}: check those hosts with `dtrun doctor` (ssh, firewall, a silent network)")


def _grow_pipe(stream) -> None:
    """A larger pipe from mpirun (Linux): fewer stalls of its output while dtrun writes ours."""
    try:
        import fcntl

        fcntl.fcntl(stream.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (OSError, ValueError, ImportError):
        pass


def _signal(proc, signum) -> None:
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
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == sid:
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


def failure_summary(result: JobResult, log_dir: Optional[str] = None, on_hang: str = "abort") -> str:
    """One summary line and a short table like torchrun's, for a failed job (``on_hang``: the
    --on-hang mode that stopped a hung job)."""
    lines = [f"dtrun: warning: {n}" for n in result.notes]
    if result.returncode == 0:
        return "\n".join(lines)
    if result.hung:
        if on_hang == "restart":
            return "\n".join(lines + ["dtrun: the job made no progress and was stopped (--on-hang restart)"])
        return "\n".join(lines + [f"dtrun: the job made no progress and was stopped (--on-hang abort; exit code "
                                  f"{int(ExitCode.HANG)})"])
    if result.interrupted:
        return "\n".join(lines + [f"dtrun: stopped by {signal_name(result.signum or signal.SIGINT)}; "
                                  f"{result.how_stopped}"])
    if result.timeout:
        return "\n".join(lines + [f"dtrun: {result.timeout}; the job was stopped (exit {int(ExitCode.TIMEOUT)}): "
                                  f"{result.how_stopped}"])
    cause = root_cause(result.failures)
    if result.stdout_closed and cause is None:
        return "\n".join(lines + ["dtrun: stdout was closed (the program reading dtrun's output exited, "
                                  "as with `| head`); the job was stopped"])
    if cause is None:
        why = result.launcher_ended
        if result.lost_daemon_host:
            why = (f"the MPI daemon on {result.lost_daemon_host} died or lost its connection (killed, out of "
                   f"memory, or the host or its network went down), so the job was ended; {why}")
        elif result.vanished:
            hosts = sorted({h for _, h in result.vanished})
            ranks = ",".join(r for r, _ in result.vanished)
            why = (f"rank{'s' if len(result.vanished) > 1 else ''} {ranks} on {', '.join(hosts)} went silent (no exit "
                   f"report): the host, its MPI daemon or its network went away; {why}")
        elif result.failures:
            stopped = ", ".join(f"rank {f.rank} on {f.host} {f.how}" for f in result.failures[:3])
            why += f" while stopping the job ({stopped})"
        return "\n".join(lines + [f"dtrun: job failed: {why}"])
    first = cause
    others = len({f.rank for f in result.failures}) - 1
    tail = f" ({others} other rank{'s' if others != 1 else ''} stopped too)" if others > 0 else ""
    head = f"rank {first.rank} on {first.host} {first.how}"
    if first.start_error:  # say it the way a shell would: "PROGRAM: command not found on HOST"
        head = f"{first.program}: {first.start_error} on {first.host} (rank {first.rank})"
    lines += [f"dtrun: job failed: {head}{tail}",
              "  first failure:",
              f"    rank       : {first.rank}",
              f"    host       : {first.host}",
              f"    {'signal' if first.signum is not None else 'exit code':<11}: "
              f"{signal_name(first.signum) + f' ({first.signum})' if first.signum is not None else first.code}"
              if first.signum is not None or first.code is not None else "    exit code  : none (MPI aborted the job)"]
    if log_dir:
        lines.append(f"    log        : {os.path.join(log_dir, f'rank.{first.rank}.log')}")
    return "\n".join(lines)
