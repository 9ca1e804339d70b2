"""Horovod's timeline: a Chrome trace of every rank's collectives, with negotiation and wait.

Turned on as Horovod's is: ``HOROVOD_TIMELINE=FILE`` at ``hvd.init()`` writes from then on;
``HOROVOD_TIMELINE=DYNAMIC`` writes nothing until ``hvd.start_timeline(file_path,
mark_cycles=False)``, and ``hvd.stop_timeline()`` closes the file (``shutdown`` does too).
``HOROVOD_TIMELINE_MARK_CYCLES=1`` (or ``mark_cycles=True``) adds a ``CYCLE_START`` instant
at each negotiation round. Without ``HOROVOD_TIMELINE`` at init, ``start_timeline`` raises
Horovod's ValueError.

The file has the format of Horovod's ``timeline.cc``, a JSON array of Chrome trace events
(chrome://tracing, https://ui.perfetto.dev), written as it goes: after every event the file
ends in ``]`` and parses. For each collective, on the tensor's row (its Horovod name, e.g.
``allreduce.loss``):

* ``NEGOTIATE_<OP>``, from this rank's submit until every rank had submitted the name: the
  wait for the others (the slowest rank has the shortest);
* ``<OP>`` (``ALLREDUCE``, ``ALLGATHER``, ``BROADCAST``, ...), the collective itself, which
  ends with ``bytes`` and the flight recorder's entries it made in its args.

Where Horovod's coordinator writes one file that models each tensor as a process, here each
rank writes its own events (Chrome's ``pid`` is the rank, ``tid`` the tensor), rank 0 to the
path and rank N to ``PATH.rankN`` (each a trace of its own). When rank 0 stops, it merges into
the path every part at ``PATH.rankN`` of the same job and session (waiting up to
``DTRUN_TIMELINE_WAIT`` seconds, default 5, for a rank still writing), with its times moved
onto rank 0's clock through each file's ``start_time_since_epoch_in_micros``. A rank whose
part sits elsewhere (another path, or another host's disk) stays in its own file only.

The flight recorder (``collectives/recorder.py``) reads no clock, by design: it numbers each
collective a rank starts. The timeline reads the monotonic clock, only while it is on, and
ties each ``<OP>`` phase to those numbers (``recorder: [first, last]``, the entries that the
phase added to this rank's recorder, for collectives on the world communicator), so a hang report
naming "allreduce #17" points at a tensor of the timeline.

Files are opened without following a symbolic link (``O_NOFOLLOW``), created with mode 0600,
and emptied only when they are a regular file of this user with no other link.

``_core`` calls ``attach(rank, size, comm)`` in ``init`` on every rank (collective: it
broadcasts a job token) and ``detach()`` in ``shutdown``; the engine calls the hooks of the
object ``current()`` returns (None while no timeline is written).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import threading
import time
import warnings
from typing import Any

import numpy as np

from ..errors import CollectiveError

ENV, ENV_CYCLES, ENV_WAIT = "HOROVOD_TIMELINE", "HOROVOD_TIMELINE_MARK_CYCLES", "DTRUN_TIMELINE_WAIT"
DYNAMIC = "DYNAMIC"
END = "dtrun_timeline_end"  # the last event of a rank's part: rank 0 need not wait for more
WAIT_S = 5.0
NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."
NOT_ENABLED = "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage."
# Horovod's request types where a kind's name is not simply its upper case.
_CATEGORY = {"reduce_scatter": "REDUCESCATTER"}


class TimelineError(CollectiveError, OSError):
    """The timeline file could not be opened or written (names the rank and the path)."""


class _Attached:
    """What ``attach`` learnt: this rank, the job's size and token, the world comm's
    recorder, whether ``HOROVOD_TIMELINE`` was set, and how many timelines were opened."""

    def __init__(self, rank: int, size: int, token: int, recorder: Any, enabled: bool):
        self.rank, self.size, self.token, self.enabled = rank, size, token, enabled
        self.recorder, self.sessions = recorder, 0


_lock = threading.RLock()
_att: _Attached | None = None
_current: "Timeline | None" = None


def current() -> "Timeline | None":
    """The timeline being written, or None (what the engine's hooks ask; costs one read)."""
    return _current


def _flag(value: str | None) -> bool:
    """Horovod's boolean variables: a positive integer (also true/yes/on here)."""
    value = (value or "").strip().lower()
    if value in ("true", "yes", "on"):
        return True
    try:
        return int(value) > 0
    except ValueError:
        return False


def attach(rank: int, size: int, comm: Any = None, environ: Any = None,
           lock: Any = None) -> None:
    """Called by ``hvd.init()`` on every rank (collective over ``comm`` when ``size > 1``: one
    8-byte broadcast of rank 0's job token, which tells this job's parts from older ones;
    under ``lock`` when given, the lock held around collectives where MPI is not
    thread-safe). Starts the timeline that ``HOROVOD_TIMELINE`` names; a file that cannot be
    opened is a warning there, as it is a log line in Horovod, and the job runs without one."""
    global _att
    environ = os.environ if environ is None else environ
    with _lock:
        if _att is not None:
            return
        token = np.array([secrets.randbits(62)], dtype=np.int64)  # not the user's seed
        if comm is not None and size > 1:
            with lock if lock is not None else contextlib.nullcontext():
                token = comm.broadcast(token, root=0)
        _att = _Attached(rank, size, int(token[0]), getattr(comm, "_recorder", None),
                         ENV in environ)
        path = environ.get(ENV, "")
        if path and path != DYNAMIC:
            try:
                _open(path, _flag(environ.get(ENV_CYCLES)))
            except TimelineError as e:
                warnings.warn(f"{e}; running without a timeline", RuntimeWarning, stacklevel=2)


def detach() -> None:
    """Called by ``hvd.shutdown()``: close the timeline (rank 0 merges the parts) and forget
    the job."""
    global _att
    with _lock:
        _close()
        _att = None


def start_timeline(file_path: Any, mark_cycles: bool = False) -> None:
    """Create a timeline file at ``file_path`` and begin recording (Horovod's
    ``hvd.start_timeline``). The same path again only changes ``mark_cycles``; another path
    closes the current file first. Raises ValueError if Horovod is not initialized or
    ``HOROVOD_TIMELINE`` was not set at init, TimelineError if the file cannot be opened."""
    with _lock:
        att = _attached()
        if not att.enabled:
            raise ValueError(NOT_ENABLED)
        path = os.path.abspath(os.fspath(file_path))
        if _current is not None and _current.path == path:
            _current.mark_cycles = bool(mark_cycles)
            return
        _close()
        _open(path, bool(mark_cycles))


def stop_timeline() -> None:
    """Stop recording and close the file (Horovod's ``hvd.stop_timeline``); rank 0's file
    then holds every rank's part it could reach. Nothing to do when none is open."""
    with _lock:
        _attached()
        _close()


def _attached() -> _Attached:
    if _att is None:
        raise ValueError(NOT_INITIALIZED)
    return _att


def _open(path: str, mark_cycles: bool) -> None:
    global _current
    att = _attached()
    att.sessions += 1
    _current = Timeline(os.path.abspath(path), att.rank, att.size, mark_cycles, att.token,
                        att.sessions, att.recorder)


def _close() -> None:
    global _current
    tl, _current = _current, None  # the hooks see None from here on
    if tl is not None:
        tl.close()


# ----------------------------------------------------------------------------- files
def open_own(path: str, rank: int) -> int:
    """A descriptor of ``path`` for writing, emptied: created with mode 0600, or an existing
    regular file of this user with one link. Never through a symbolic link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if os.path.islink(path):
            raise TimelineError("timeline", rank, f"{path} is a symbolic link; the timeline never "
                                "writes through one: remove it or choose another path") from None
        raise TimelineError("timeline", rank, f"{path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_uid != os.geteuid():
            problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
        elif st.st_nlink > 1:
            problem = "has other hard links"
        if problem:
            raise TimelineError("timeline", rank, f"{path} {problem}; the timeline writes only a "
                                "file of its own: remove it or choose another path")
        os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_own(path: str) -> bytes | None:
    """The bytes of ``path`` when it is a regular file of this user (None otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def parse_events(data: bytes) -> list[dict]:
    """The events of a timeline file, also of one still being written: each event is one
    line, and a line that does not parse (the one being written) is left out."""
    try:
        events = json.loads(data)
        if isinstance(events, list):
            return [e for e in events if isinstance(e, dict)]
    except ValueError:
        pass
    out = []
    for line in data.splitlines():
        line = line.strip().lstrip(b"[").rstrip(b",]").strip()
        if line.startswith(b"{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def category(kind: str) -> str:
    """Horovod's name of a collective's phase (``allreduce`` -> ``ALLREDUCE``)."""
    base = kind[len("grouped_"):] if kind.startswith("grouped_") else kind
    base = base[:-len("_object")] if base.endswith("_object") else base
    return _CATEGORY.get(base, base.upper())


def _wait_s() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_WAIT, "") or WAIT_S))
    except ValueError:
        return WAIT_S


def _writer_gone(header: dict) -> bool:
    """Whether the process that writes a part has ended (known only on this host)."""
    who = header.get("args", {}).get("dtrun", {})
    if who.get("host") != socket.gethostname() or not isinstance(who.get("os_pid"), int):
        return False
    try:
        os.kill(who["os_pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


# ----------------------------------------------------------------------------- one file
class Timeline:
    """This rank's timeline file (see the module doc). The hooks are what the engine calls,
    from its thread and from user threads: each reads the clock, then writes one event under
    a lock; after ``close`` they do nothing."""

    def __init__(self, path: str, rank: int, size: int, mark_cycles: bool, token: int,
                 session: int, recorder: Any = None):
        self.path, self.rank, self.size = path, rank, size
        self.mark_cycles, self.token, self.session = mark_cycles, token, session
        self.file = path if rank == 0 else f"{path}.rank{rank}"
        self._lock = threading.Lock()
        # the recorder ring's sequence words: the newest is the highest
        self._seqs = None if recorder is None else np.frombuffer(recorder.ring, np.int64)[0::2]
        self._tids: dict[str, int] = {}
        self._open: dict[str, tuple] = {}  # name -> ("negotiate",) or ("op", recorder seq)
        self._end, self._closed = 0, False
        self._fd = open_own(self.file, rank)
        self._t0 = time.monotonic_ns()
        self.epoch_us = time.time_ns() // 1000  # Horovod's start_time_since_epoch_in_micros
        self._write(self._header(), first=True)

    def _header(self) -> list[dict]:
        who = {"token": self.token, "session": self.session, "rank": self.rank,
               "size": self.size, "host": socket.gethostname(), "os_pid": os.getpid()}
        return [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank}",
                          "start_time_since_epoch_in_micros": self.epoch_us, "dtrun": who}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]

    def _ts(self) -> float:
        return round((time.monotonic_ns() - self._t0) / 1000, 3)

    def _seq(self) -> int:
        return 0 if self._seqs is None else int(self._seqs.max())

    def _write(self, events: list[dict], first: bool = False) -> None:
        """Append ``events``, the file ending in ``]`` after each write as Horovod's does."""
        data = ",\n".join(json.dumps(e) for e in events).encode()
        blob, at = (b"[\n" + data + b"]", 0) if first else (b",\n" + data + b"]", self._end)
        try:
            os.pwrite(self._fd, blob, at)
        except OSError as e:
            if first:
                os.close(self._fd)
                raise TimelineError("timeline", self.rank, f"{self.file}: {e.strerror}") from None
            self._closed = True
            warnings.warn(f"timeline on rank {self.rank}: writing {self.file} failed "
                          f"({e.strerror}); the timeline stops here", RuntimeWarning)
            return
        self._end = at + len(blob) - 1

    def _row(self, name: str, out: list[dict]) -> int:
        """The tensor's row (its ``tid``), named in ``out`` the first time."""
        tid = self._tids.get(name)
        if tid is None:
            tid = self._tids[name] = len(self._tids) + 1
            out += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                     "args": {"name": name}},
                    {"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid,
                     "args": {"sort_index": tid}}]
        return tid

    def _phase(self, ph: str, name: str, ts: float, what: str = "", args: Any = None,
               out: list | None = None) -> list[dict]:
        out = [] if out is None else out
        event = {"ph": ph, "ts": ts, "pid": self.rank, "tid": self._row(name, out)}
        if what:
            event["name"] = what
        if args:
            event["args"] = args
        out.append(event)
        return out

    # ------------------------------------------------------------------ the engine's hooks
    def cycle_start(self) -> None:
        """A negotiation round begins (marked when mark_cycles is on)."""
        if not self.mark_cycles:
            return
        event = {"ph": "i", "name": "CYCLE_START", "ts": self._ts(), "pid": self.rank, "s": "p"}
        with self._lock:
            if not self._closed:
                self._write([event])

    def negotiate_start(self, name: str, kind: str) -> None:
        """This rank submitted ``name``: its wait for the other ranks begins."""
        ts = self._ts()
        with self._lock:
            if self._closed or name in self._open:
                return  # the first call counts, as in Horovod
            self._open[name] = ("negotiate",)
            self._write(self._phase("B", name, ts, "NEGOTIATE_" + category(kind)))

    def negotiate_end(self, name: str, kind: str, ranks: Any = None) -> None:
        """Every rank has submitted ``name`` (``ranks``: those that did, as the engine saw)."""
        ts = self._ts()
        with self._lock:
            if self._closed or self._open.get(name, ("",))[0] != "negotiate":
                return
            del self._open[name]
            self._write(self._phase("E", name, ts, args=None if ranks is None else
                                    {"ranks": [int(r) for r in ranks]}))

    def op_start(self, name: str, kind: str) -> None:
        """The collective ``name`` starts on this rank."""
        ts = self._ts()
        with self._lock:
            state = self._open.get(name, ("",))[0]
            if self._closed or state == "op":
                return
            out = self._phase("E", name, ts) if state == "negotiate" else []
            self._open[name] = ("op", self._seq())
            self._write(self._phase("B", name, ts, category(kind), out=out))

    def op_end(self, name: str, kind: str, nbytes: Any = None) -> None:
        """The collective ``name`` finished on this rank (``nbytes``: its tensors' bytes)."""
        ts = self._ts()
        with self._lock:
            state = self._open.get(name, ("",))
            if self._closed or state[0] != "op":
                return
            del self._open[name]
            args: dict[str, Any] = {} if nbytes is None else {"bytes": int(nbytes)}
            last = self._seq()
            if last > state[1]:
                args["recorder"] = [state[1] + 1, last]
            self._write(self._phase("E", name, ts, args=args))

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """End the open phases and the file; rank 0 then merges the other ranks' parts."""
        with self._lock:
            if self._closed:
                return
            ts, out = self._ts(), []
            for name in list(self._open):
                self._phase("E", name, ts, args={"unfinished": True}, out=out)
            self._open.clear()
            if self.rank != 0:
                out.append({"name": END, "ph": "M", "pid": self.rank,
                            "args": {"session": self.session}})
            if out:
                self._write(out)
            closed, self._closed = self._closed, True  # a failed write closed it already
        try:
            if self.rank == 0 and self.size > 1 and not closed:
                self._merge()
        finally:
            os.close(self._fd)

    def _merge(self) -> None:
        """Add every rank's part of this job and session (see the module doc)."""
        pending = {r: f"{self.path}.rank{r}" for r in range(1, self.size)}
        deadline, delay, merged = time.monotonic() + _wait_s(), 0.002, []
        while pending:
            for r, part in list(pending.items()):
                got = self._part(part)
                if got is None:
                    del pending[r]  # none, or another job's or session's: not ours to wait for
                    continue
                events, done = got
                if done or time.monotonic() >= deadline or _writer_gone(events[0]):
                    merged += self._moved(events, done)
                    del pending[r]
            if pending:
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
        if merged:
            self._write(merged)

    def _part(self, path: str) -> tuple[list[dict], bool] | None:
        """A part's events and whether its rank closed it; None unless it is this job's and
        session's."""
        data = _read_own(path)
        events = parse_events(data) if data else []
        if not events or events[0].get("name") != "process_name":
            return None
        who = events[0].get("args", {}).get("dtrun", {})
        if who.get("token") != self.token or who.get("session") != self.session:
            return None
        done = any(e.get("name") == END and e.get("ph") == "M" for e in events)
        return [e for e in events if e.get("name") != END], done

    def _moved(self, events: list[dict], done: bool) -> list[dict]:
        """A part's events on this file's clock (its start differs from ours)."""
        head = events[0]["args"]
        shift = float(head.get("start_time_since_epoch_in_micros", self.epoch_us)) - self.epoch_us
        if not done:
            head["dtrun"]["complete"] = False  # its rank never closed it: the end may be missing
        for e in events:
            if isinstance(e.get("ts"), (int, float)):
                e["ts"] = round(e["ts"] + shift, 3)
        return events
