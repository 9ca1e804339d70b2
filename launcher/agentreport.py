"""The host agent's answers (launcher/remote/agent.py), parsed once into frozen dataclasses.

The agent prints JSON: for ``dump`` one object with every rank's threads and flight
recorder (``parse_dump``), for ``watch`` one line per interval with each rank's progress
(``parse_watch``), for ``sample`` one line per window saying how each rank spent it
(``parse_sample``). Much of it was read from files a rank's own program can rewrite (its
state file, its faulthandler's output, its recorder), so the parsing is tolerant, as the
agent is: a missing field or one of the wrong type becomes None, zero or empty, a frame or
recorder entry that cannot be read is left out, and nothing here raises. The hang report
(stacks.py), the hang watch (hangwatch.py), the straggler finding (straggler.py) and
``dtrun top`` (top.py) read these types only, never the JSON.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _whole(value: Any) -> Optional[int]:
    """A count sent as a number (an int, or a float JSON wrote for one)."""
    number = _float(value)
    return int(number) if number is not None and math.isfinite(number) else None


def _text(value: Any) -> Optional[str]:
    return value if isinstance(value, str) else None


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


# ------------------------------------------------------------------ dump: stacks and recorders

@dataclass(frozen=True)
class Frame:
    """One frame of a thread's stack."""

    func: str = "?"
    file: str = ""
    line: int = 0  # 0: not known (a native frame)
    code: str = ""  # the source line, for the innermost frames of a file on the rank's host


@dataclass(frozen=True)
class Thread:
    name: str = "?"
    main: bool = False
    frames: tuple[Frame, ...] = ()  # innermost first


@dataclass(frozen=True)
class RecEntry:
    """One collective in a rank's flight recorder."""

    seq: int
    op: str
    dtype: str
    count: int
    root: Optional[int] = None


@dataclass(frozen=True)
class RankStack:
    """One rank as the agent's ``dump`` describes it."""

    rank: int
    host: str
    pid: Optional[int] = None
    alive: bool = True
    state: Optional[str] = None  # from /proc; None: not read
    wchan: str = ""
    source: Optional[str] = None  # where the threads came from: py-spy, faulthandler, gdb
    error: Optional[str] = None
    threads: tuple[Thread, ...] = ()
    recorder: tuple[RecEntry, ...] = ()  # oldest first

    @property
    def main_thread(self) -> Optional[Thread]:
        return next((t for t in self.threads if t.main), self.threads[0] if self.threads else None)

    @property
    def recorder_head(self) -> Optional[RecEntry]:
        """The newest entry of its flight recorder."""
        return self.recorder[-1] if self.recorder else None


def _frame(d: Any) -> Optional[Frame]:
    if not isinstance(d, dict):
        return None
    return Frame(func=_text(d.get("func")) or "?", file=_text(d.get("file")) or "", line=_int(d.get("line")) or 0,
                 code=_text(d.get("code")) or "")


def _thread(d: Any) -> Optional[Thread]:
    if not isinstance(d, dict):
        return None
    frames = tuple(f for f in map(_frame, _list(d.get("frames"))) if f is not None)
    return Thread(name=_text(d.get("name")) or "?", main=d.get("main") is True, frames=frames)


def _entry(d: Any) -> Optional[RecEntry]:
    if not isinstance(d, dict) or _int(d.get("seq")) is None:
        return None
    return RecEntry(seq=d["seq"], op=_text(d.get("op")) or "", dtype=_text(d.get("dtype")) or "",
                    count=_int(d.get("count")) or 0, root=_int(d.get("root")))


def parse_rank(d: Any, host: str) -> Optional[RankStack]:
    """One rank of a ``dump``; None when it has no rank number (it cannot be named).
    ``host``: the host that answered, for a rank whose record names none."""
    if not isinstance(d, dict) or _int(d.get("rank")) is None:
        return None
    return RankStack(rank=d["rank"], host=_text(d.get("host")) or host, pid=_int(d.get("pid")),
                     alive=d.get("alive", True) is not False, state=_text(d.get("state")),
                     wchan=_text(d.get("wchan")) or "", source=_text(d.get("source")), error=_text(d.get("error")),
                     threads=tuple(t for t in map(_thread, _list(d.get("threads"))) if t is not None),
                     recorder=tuple(e for e in map(_entry, _list(d.get("recorder"))) if e is not None))


def parse_dump(data: Any, host: str) -> Optional[tuple[RankStack, ...]]:
    """The ranks of one host's ``dump`` answer (its decoded JSON); None when it is not one."""
    if not isinstance(data, dict):
        return None
    return tuple(r for r in (parse_rank(d, host) for d in _list(data.get("ranks"))) if r is not None)


# ------------------------------------------------------------------ watch: progress per interval

def parse_watch(data: Any) -> Optional[dict[str, tuple[Optional[int], Optional[int]]]]:
    """The ranks of one ``watch`` line: rank → (the newest sequence number in its flight
    recorder, the size of its log), each None where there is none; None when the line is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), dict):
        return None
    return {str(rank): (_int(pair[0]), _int(pair[1])) for rank, pair in data["ranks"].items()
            if isinstance(pair, list) and len(pair) == 2}


# ------------------------------------------------------------------ sample: one window per host

class SampledFrame(NamedTuple):
    """Where a rank's stack samples were in a window, and how many."""

    func: str
    file: str
    line: int
    count: int
    waiting: bool  # inside MPI, torch.distributed or NCCL: waiting for its peers


def combined_share(flag: Optional[float], sampled: Optional[float]) -> Optional[float]:
    """The waiting share from the recorder's flag and from stack samples, where both exist:
    the larger. The flag is exact but covers blocking collectives only; the samples also see
    a rank waiting on a non-blocking collective's handle (collectives.dp overlaps them with
    the backward pass), or in MPI or torch.distributed calls of its own."""
    if flag is None or sampled is None:
        return sampled if flag is None else flag
    return max(flag, sampled)


@dataclass(frozen=True)
class RankView:
    """One rank in one window, as its host's agent measured it."""

    rank: int
    host: str
    pid: Optional[int] = None
    state: str = ""
    cpu: Optional[float] = None
    rss: Optional[int] = None
    span: float = 0.0
    colls: Optional[int] = None  # collectives started in the window (recorder sequence)
    rec_polls: int = 0  # reads of the recorder's "inside a collective" flag in the window
    rec_inside: int = 0  # ... that found it set
    samples: int = 0
    waiting: int = 0
    startup: int = 0  # samples in imports or process-group set-up (not counted in samples)
    frames: tuple[SampledFrame, ...] = ()  # most samples first
    via: str = ""
    gpu_util: Optional[float] = None
    gpu_mem: Optional[float] = None
    error: Optional[str] = None
    stack_error: Optional[str] = None
    ended: bool = False

    @property
    def wait_share(self) -> Optional[float]:
        return combined_share(self.rec_inside / self.rec_polls if self.rec_polls else None,
                              self.waiting / self.samples if self.samples else None)

    @property
    def rate(self) -> Optional[float]:
        return self.colls / self.span if self.colls is not None and self.span > 0 else None

    @property
    def frame(self) -> Optional[SampledFrame]:
        return self.frames[0] if self.frames else None


def _sampled_frame(f: Any) -> Optional[SampledFrame]:
    if not isinstance(f, list) or len(f) != 5:
        return None
    func, path, line, count, waiting = f
    if not (isinstance(func, str) and isinstance(path, str) and _int(line) is not None and _int(count) is not None):
        return None
    return SampledFrame(func, path, line, count, bool(waiting))


def parse_rank_view(d: Any, host: str) -> Optional[RankView]:
    """One rank of a ``sample`` line; None when it has no rank number."""
    if not isinstance(d, dict) or _int(d.get("rank")) is None:
        return None

    def count(key):
        return _whole(d.get(key)) or 0

    return RankView(rank=d["rank"], host=host, pid=_whole(d.get("pid")), state=_text(d.get("state")) or "",
                    cpu=_float(d.get("cpu")), rss=_whole(d.get("rss")),
                    span=_float(d.get("span")) or 0.0, colls=_whole(d.get("colls")), rec_polls=count("rec_polls"),
                    rec_inside=count("rec_inside"), samples=count("samples"), startup=count("startup"),
                    waiting=count("waiting"),
                    frames=tuple(f for f in map(_sampled_frame, _list(d.get("frames"))) if f is not None),
                    via=_text(d.get("via")) or "", gpu_util=_float(d.get("gpu_util")),
                    gpu_mem=_float(d.get("gpu_mem")), error=_text(d.get("error")),
                    stack_error=_text(d.get("stack_error")), ended=bool(d.get("ended")))


@dataclass(frozen=True)
class HostSample:
    """One host's answer for one window (or why there is none: ``error``)."""

    host: str  # as the job names it (what ssh reaches)
    name: str = ""  # as the host names itself
    ranks: tuple[RankView, ...] = ()
    gpus: tuple[dict, ...] = ()  # as the agent read them from nvidia-smi; shown by `dtrun top --json`
    error: Optional[str] = None
    at: float = 0.0  # when it arrived (this machine's monotonic clock)
    window: float = 0.0

    @property
    def starting(self) -> bool:
        """Whether a rank here was still starting (imports, set-up) in this window."""
        return any(v.startup for v in self.ranks)


def parse_sample(data: Any, host: str, window: float) -> Optional[HostSample]:
    """One ``sample`` line of ``host`` (its decoded JSON); None when it is not one.
    ``window``: the seconds asked for, where the line does not say."""
    if not isinstance(data, dict):
        return None
    name = data.get("host")
    name = name if isinstance(name, str) and name else host
    ranks = tuple(v for v in (parse_rank_view(d, name) for d in _list(data.get("ranks"))) if v is not None)
    gpus = tuple(g for g in _list(data.get("gpus")) if isinstance(g, dict))
    sent = _float(data.get("window"))
    return HostSample(host, name, ranks, gpus, window=window if sent is None else sent)
