"""mpirun's stdout and stderr, copied to dtrun's own: the one place a job's output flows through.

stdout is read as fast as mpirun writes it and buffered here, because Open MPI drops a
remote rank's pending output when the job ends while its stdout is a slow pipe; stderr
is read line by line to pick out the rank wrapper's start and exit markers.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from dtrun.launcher.job import parsers
from dtrun.launcher.job.markers import parse_marker, parse_start_marker, split_eof_markers
from dtrun.launcher.job.result import RankFailure

# Buffered stdout beyond which reading from mpirun pauses (and output may be dropped by it).
STDOUT_BUFFER_MAX = 256 << 20
# Characters of stdout's end kept for mpirun's reports at a job's end (at least the last chunk read).
STDOUT_TAIL_CHARS = 16 << 10


@dataclass(frozen=True)
class PumpHooks:
    """What the pumps tell the supervisor: a rank's exit and start markers, and stdout gone."""

    on_marker: Callable[[RankFailure], None]
    on_start_marker: Callable[[str, str], None]
    on_stdout_closed: Callable[[], None]


class OutputPumps:
    """Three threads: read mpirun's stdout, write it to dtrun's, read mpirun's stderr."""

    def __init__(self, proc, observers: Sequence, hooks: PumpHooks, token: str = ""):
        self.proc = proc
        self.token = token  # the job's marker token (wire.MARKER_TOKEN_ENV)
        self.observers = observers
        self.hooks = hooks
        self.ompi_report: list[str] = []
        self.stderr_tail: collections.deque = collections.deque(maxlen=200)
        self.eof_ranks: set = set()  # ranks whose end-of-output marker arrived
        self.stdout_head: list[str] = []  # the first PMIX_SCAN_BYTES (mpirun's reports about daemons)
        self._stdout_tail: collections.deque = collections.deque()  # the last STDOUT_TAIL_CHARS or more
        self._stdout_tail_chars = 0
        self._stdout_seen = 0
        self._chunks: collections.deque = collections.deque()
        self._buffered = 0
        self.throttled = False
        self._cond = threading.Condition()
        self._eof = False
        self._ends_lock = threading.Lock()
        self._last = {"stdout": b"\n", "stderr": b"\n", "either": b"\n"}  # the last byte passed on to each
        self.threads = [threading.Thread(target=self._read_stdout, daemon=True),
                        threading.Thread(target=self._write_stdout, daemon=True),
                        threading.Thread(target=self._read_stderr, daemon=True)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout: float, drain: bool) -> None:
        """Wait for the readers (at most ``timeout``), then for all of stdout to be written
        out (without a limit when ``drain``: output is not dropped because a reader is slow)."""
        deadline = time.monotonic() + timeout
        for t in (self.threads[0], self.threads[2]):
            t.join(max(0.0, deadline - time.monotonic()))
        self.threads[1].join(None if drain else max(1.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self.threads):
            self._end_line()

    def _passed(self, stream: str, data: bytes) -> None:
        if data:
            with self._ends_lock:
                self._last[stream] = self._last["either"] = data[-1:]

    def _end_line(self) -> None:
        """End the line mpirun's output left open, so that dtrun's own lines (on stderr) start on
        a fresh one: one its stderr left open, or its stdout when both go to the same place."""
        with self._ends_lock:
            last = self._last["either"] if _same_file(sys.stdout, sys.stderr) else self._last["stderr"]
        if last == b"\n":
            return
        try:
            if hasattr(sys.stderr, "buffer"):
                sys.stderr.buffer.write(b"\n")
                sys.stderr.buffer.flush()
            else:
                sys.stderr.write("\n")
                sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def _notify(self, stream: str, data: bytes) -> None:
        for o in self.observers:
            o.on_output(stream, data)

    def _read_stdout(self) -> None:
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
                if text:
                    line_start = text.endswith("\n")
                    self._pass_stdout(text)
            if held:
                self._put(held.encode("utf-8", "surrogateescape"))
        except OSError:
            pass
        finally:
            with self._cond:
                self._eof = True
                self._cond.notify_all()

    def _pass_stdout(self, text: str) -> None:
        data = text.encode("utf-8", "surrogateescape")
        if self._stdout_seen < parsers.PMIX_SCAN_BYTES:  # they come before any rank's output
            self._stdout_seen += len(data)
            self.stdout_head.append(text)
        self._stdout_tail.append(text)
        self._stdout_tail_chars += len(text)
        while self._stdout_tail_chars - len(self._stdout_tail[0]) >= STDOUT_TAIL_CHARS:
            self._stdout_tail_chars -= len(self._stdout_tail.popleft())
        self._notify("stdout", data)
        with self._cond:
            while self._buffered > STDOUT_BUFFER_MAX and not self._eof:
                self.throttled = True
                self._cond.wait(0.5)
            self._chunks.append(data)
            self._buffered += len(data)
            self._cond.notify_all()

    def _put(self, data: bytes) -> None:
        with self._cond:
            self._chunks.append(data)
            self._buffered += len(data)
            self._cond.notify_all()

    def _write_stdout(self) -> None:
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
                self._passed("stdout", data)
            except (BrokenPipeError, OSError, ValueError):
                broken = True
                self.hooks.on_stdout_closed()

    def _read_stderr(self) -> None:
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        own = parsers.LauncherStderr()  # mpirun's own lines lose their control bytes, ranks' pass as they are
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace")
            started = parse_start_marker(line, self.token)
            if started is not None:
                own.saw_start_marker(raw)
                self.hooks.on_start_marker(*started)
                continue
            failure = parse_marker(line, self.token)
            if failure is not None:
                self.hooks.on_marker(failure)
                continue
            raw = own.clean(raw)
            if not raw:
                continue
            line = raw.decode("utf-8", "replace")
            self.stderr_tail.append(line)
            if parsers.is_report_line(line):
                self.ompi_report.append(line)
            self._notify("stderr", raw)
            try:
                if out is not None:
                    out.write(raw)
                    out.flush()
                else:
                    sys.stderr.write(line)
                self._passed("stderr", raw)
            except (OSError, ValueError):
                pass

    def reported_rank(self) -> Optional[str]:
        """The rank Open MPI names as the first to fail, if it said."""
        return parsers.reported_rank("".join(self.ompi_report))

    def killed_rank(self) -> Optional[RankFailure]:
        return parsers.killed_rank("".join(self.ompi_report))

    def fallback_failure(self) -> Optional[RankFailure]:
        return parsers.fallback_failure("".join(self.ompi_report))

    def stderr_text(self) -> str:
        """The last lines of mpirun's stderr that were not markers."""
        return "".join(self.stderr_tail)

    def stdout_tail_text(self) -> str:
        """The end of mpirun's stdout: at least its last ``STDOUT_TAIL_CHARS`` characters (where
        Open MPI 5 reports a daemon's exit status at the job's end)."""
        return "".join(self._stdout_tail)


def _same_file(a, b) -> bool:
    """Whether two streams write to the same file, pipe or terminal (``2>&1``, both on a terminal)."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
