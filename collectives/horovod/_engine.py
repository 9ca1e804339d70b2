"""The engine that matches the Horovod adapter's collectives by name, in the background.

Horovod keys every collective by its name (``allreduce(t, name="loss")``; unnamed ones get
``allreduce.noname.<n>``, counted per operation): a collective runs once every rank of its
process set has submitted that name, whatever order the ranks submitted in, and a name
whose shapes or dtypes differ across ranks is an error naming the ranks. As Horovod's, each
engine (one per process set) has a background thread: ``submit`` queues a request and
returns; the thread runs negotiation rounds with the other ranks' threads (one small
allgather of every rank's queued names on a private duplicate of the set's communicator)
and runs each name queued on every rank, in the order the lowest-numbered rank queued them.
So ``poll`` tells the truth, and collectives submitted from several threads (TensorFlow's
graph executor) pair by name, never by the order the threads happen to run in.

Every decision is taken from the round's tables, which every rank sees alike, so the ranks
never disagree: what runs, a shutdown (a rank that leaves says so in its next round; every
other rank's pending and later collectives then fail with Horovod's "Horovod has been shut
down", naming it), a removed process set, a deadlock (every rank blocked on names no other
rank submitted, for ``DTRUN_HVD_DEADLOCK_S`` seconds by rank 0's clock: an error naming
what each rank waits for, on every rank). Where MPI gives no MPI_THREAD_MULTIPLE the
rounds run in the caller's thread instead, inside ``synchronize``.

Standard library and NumPy only at import; the communicators come from ``_core``.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import CollectiveError, MismatchError
from ._arrays import OP_NAMES as _OP_NAMES
from ._arrays import Average, Sum, _is_bf16, neutral


class HorovodInternalError(CollectiveError, RuntimeError):
    """A collective failed (Horovod's exception name, so ``except`` clauses keep working)."""


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 (Horovod's name)
    """Hosts were added or removed (elastic runs): raised on every rank at the same commit.
    ``skip_sync``: only hosts were removed, so the ranks that remain need no new sync."""

    def __init__(self, skip_sync: bool = False):
        super().__init__(skip_sync)
        self.skip_sync = skip_sync


class HorovodMismatchError(MismatchError, RuntimeError):
    """Ranks submitted the same name with different shapes, dtypes, ops or roots: a
    ValueError and, as Horovod's PyTorch error for these, a RuntimeError."""


class DuplicateNameError(CollectiveError, ValueError):
    """A name submitted while a collective of that name is still pending on this rank."""


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected a number >= 0")
    return value


CYCLE_S = _env_float("HOROVOD_CYCLE_TIME", 1.0) / 1000  # Horovod's variable, in ms
IDLE_CYCLE_S = max(CYCLE_S, 0.01)  # after IDLE_ROUNDS rounds with nothing queued anywhere
IDLE_ROUNDS = 200
DEADLOCK_S = _env_float("DTRUN_HVD_DEADLOCK_S", 5.0)
SLOT = 512  # bytes per rank in a round's first exchange (most tables fit)
STOP_WAIT_S = 10.0  # how long shutdown waits for the other ranks' threads to see it
_ABANDONED: list = []  # buffers of exchanges left in flight (MPI owns them)


@dataclass
class Request:
    """One queued collective: what every rank compares, and how to run it."""

    kind: str            # allreduce, allgather, broadcast, ..., barrier, broadcast_object
    name: str
    shapes: tuple        # one shape per tensor (grouped: several)
    dtypes: tuple
    op: str = ""
    root: int = -1
    run: Callable[[], Any] | None = None          # the collective, on this rank's data
    result: Any = None
    error: BaseException | None = None
    done: bool = False

    def signature(self) -> tuple:
        return (self.kind, self.shapes, self.dtypes, self.op, self.root)


class Handle:
    """What ``*_async`` returns; pass it to ``poll`` or ``synchronize``."""

    __slots__ = ("request",)

    def __init__(self, request: Request):
        self.request = request

    def __repr__(self) -> str:
        r = self.request
        return f"<Handle {r.kind} {r.name!r} {'done' if r.done else 'pending'}>"


_VARIABLE_FIRST_DIM = ("allgather", "alltoall", "grouped_allgather")
# The dtype a rank submits for an argument that is not a tensor ("<not a tensor>list"): the
# name still runs its negotiation, so every rank gets the mismatch error instead of waiting.
NOT_A_TENSOR = "<not a tensor>"


def compare(name: str, sigs: list[tuple[int, tuple]]) -> str | None:
    """Why the ranks' submissions of ``name`` cannot run together (None if they can).
    ``sigs``: (rank, signature) for every rank that submitted it."""
    r0, ref = sigs[0]
    kind = ref[0]
    for r, sig in sigs:
        for i, dt in enumerate(sig[2]):
            if dt.startswith(NOT_A_TENSOR):
                what = f" tensor {i}" if len(sig[2]) > 1 else ""
                return (f"{kind} {name!r}{what} is {dt[len(NOT_A_TENSOR):]} on rank {r}, not a "
                        "tensor")
    for r, sig in sigs[1:]:
        problem = _differs(name, kind, r, sig, r0, ref)
        if problem:
            return problem
    return None


def _differs(name: str, kind: str, r: int, sig: tuple, r0: int, ref: tuple) -> str | None:
    if sig[0] != kind:
        return f"{name!r} is {sig[0]} on rank {r} but {kind} on rank {r0}"
    if len(sig[1]) != len(ref[1]):
        return f"{kind} {name!r} has {len(sig[1])} tensors on rank {r} but {len(ref[1])} on rank {r0}"
    for i, (shape, rshape) in enumerate(zip(sig[1], ref[1])):
        what = f"{kind} {name!r}" + (f" tensor {i}" if len(ref[1]) > 1 else "")
        if sig[2][i] != ref[2][i]:
            return f"{what} is {sig[2][i]} on rank {r} but {ref[2][i]} on rank {r0}"
        if kind in _VARIABLE_FIRST_DIM:
            if len(shape) != len(rshape) or tuple(shape[1:]) != tuple(rshape[1:]):
                return (f"{what} has shape {tuple(shape)} on rank {r} but {tuple(rshape)} "
                        f"on rank {r0}; only the first dimension may differ")
        elif tuple(shape) != tuple(rshape):
            return f"{what} has shape {tuple(shape)} on rank {r} but {tuple(rshape)} on rank {r0}"
    if sig[3] != ref[3]:
        return (f"{kind} {name!r} uses op {_OP_NAMES.get(sig[3], sig[3])} on rank {r} but "
                f"{_OP_NAMES.get(ref[3], ref[3])} on rank {r0}")
    if sig[4] != ref[4]:
        return f"{kind} {name!r} has root_rank {sig[4]} on rank {r} but {ref[4]} on rank {r0}"
    return None


def _timeline():
    """The timeline being written (None: none). ``_core.init`` imports its module."""
    current = getattr(sys.modules.get(__package__ + "._timeline"), "current", None)
    return None if current is None else current()


@dataclass
class _Table:
    """What one rank says in a round (pickled; every rank gets every rank's)."""

    pending: list        # [(name, signature)] in submission order; [] once joined
    joined_at: int       # the round this rank joined at (-1: not joined)
    counters: dict       # unnamed-name counters (sent while joined, to resume alike)
    blocked: bool        # a thread of this rank waits in synchronize or join
    leaving: bool        # this rank shuts down (any rank: every rank stops)
    removing: bool       # this rank removes the process set (all ranks: it stops)
    deadlock: bool       # rank 0 only: the blocked state outlived DEADLOCK_S


class Engine:
    """Queues requests and runs them once every rank of the set has submitted the same
    name (see the module docstring). ``comm``: the set's ``collectives.Comm``; ``ranks``:
    the set's global ranks (for messages); ``lock``: held around every collective where
    MPI is not thread-safe (then there is no background thread)."""

    def __init__(self, comm: Any, ranks: list[int], threaded: bool, lock: Any = None,
                 what: str = "Horovod"):
        self.comm, self.ranks, self.lock, self.what = comm, list(ranks), lock, what
        self.neg = comm.mpi.Dup()
        self.me = self.neg.Get_rank()
        self.rank = self.ranks[self.me]
        self.cv = threading.Condition(threading.RLock())
        self.pending: dict[str, Request] = {}  # insertion order = submission order
        self.counters: dict[str, int] = {}
        self.joined_at = -1
        self.join_result: int | None = None
        self.blocked = 0          # threads waiting in synchronize/join
        self.leaving = self.removing = False
        self.gone: int | None = None         # the rank whose shutdown stopped the engine
        self.stopped: str | None = None      # why the engine stopped (None: running)
        self.rounds = 0
        self.joined_now = False   # some rank has joined, in the round running now
        self._stuck_since: float | None = None
        self._idle_rounds = 0
        self.thread = None
        if threaded:
            self.thread = threading.Thread(target=self._loop, name=f"dtrun-hvd-{what}",
                                           daemon=True)
            self.thread.start()

    # ------------------------------------------------------------------ the caller's side
    def name(self, kind: str, name: str | None) -> str:
        if name is not None:
            return str(name)
        with self.cv:
            n = self.counters.get(kind, 0)
            self.counters[kind] = n + 1
        return f"{kind}.noname.{n}"

    def submit(self, req: Request) -> Handle:
        with self.cv:
            if self.stopped is not None:
                raise self.stopped_error(req.kind, req.name)
            if req.name in self.pending:
                raise DuplicateNameError(
                    req.kind, self.rank, f"a collective named {req.name!r} is already pending "
                    "on this rank; synchronize it first or use another name")
            self.pending[req.name] = req
            tl = _timeline()
            if tl is not None:
                tl.negotiate_start(req.name, req.kind)
            self.cv.notify_all()
        return Handle(req)

    def run(self, kind: str, name: str | None, fn: Callable[[], Any], root: int = -1) -> Any:
        """``fn``, a collective with no tensor to compare (barrier, the object
        collectives), run as a named request: matched, and failed, like the others."""
        req = Request(kind, self.name(kind, name), (), (), "", root, fn)
        return self.synchronize(self.submit(req))

    def synchronize(self, handle: Handle) -> Any:
        req = handle.request
        with self.cv:
            self._wait_until(lambda: req.done)
        if req.error is not None:
            raise req.error
        return req.result

    def poll(self, handle: Handle) -> bool:
        """Done yet? Never waits (without a background thread: one round, which does)."""
        req = handle.request
        if not req.done and self.thread is None:
            with self.cv:
                if not req.done:
                    self._round()
        return req.done

    def join(self) -> int:
        """Take part in the other ranks' allreduces with neutral tensors
        until every rank has joined; return the rank that joined last."""
        with self.cv:
            if self.stopped is not None:
                raise self.stopped_error("join", "join")
            self.joined_at = self.rounds
            self.join_result = None
            self.cv.notify_all()
            try:
                self._wait_until(lambda: self.join_result is not None or self.stopped is not None)
            finally:
                self.joined_at = -1
            if self.join_result is None:
                raise self.stopped_error("join", "join")
            return self.join_result

    def _wait_until(self, done: Callable[[], bool]) -> None:
        """Block this thread (holding ``cv``) until ``done()``: counted as blocked, so that
        every rank blocked on names no other rank submitted is found to be a deadlock."""
        self.blocked += 1
        try:
            while not done():
                if self.thread is None:
                    self._round()
                else:
                    self.cv.wait(0.5)
        finally:
            self.blocked -= 1

    def stop(self, removing: bool = False) -> None:
        """Leave (shutdown; ``removing``: the process set is removed on every rank): say so
        in the next round, wait for it (at most STOP_WAIT_S), fail what is pending."""
        with self.cv:
            if self.stopped is None:
                if removing:
                    self.removing = True
                else:
                    self.leaving = True
                self.cv.notify_all()
                deadline = time.monotonic() + STOP_WAIT_S
                while self.stopped is None and self.thread is not None \
                        and self.thread.is_alive() and time.monotonic() < deadline:
                    self.cv.wait(0.1)
                if self.stopped is None:
                    self._stop("this rank shut down (hvd.shutdown()) before it ran")
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=1.0)

    def stopped_error(self, kind: str, name: str) -> HorovodInternalError:
        """Horovod's error for a collective that cannot run any more."""
        if self.gone is not None and self.gone != self.rank:
            r = self.gone
            return HorovodInternalError(
                kind, self.rank,
                f"Horovod has been shut down: rank {r} shut down (hvd.shutdown(), or its "
                f"program ended) without running {name!r}. This was caused by an exception on "
                f"rank {r} or an attempt to run a collective after rank {r} finished "
                f"execution; see rank {r}'s output")
        return HorovodInternalError(kind, self.rank, f"Horovod has been shut down: {self.stopped}")

    # ------------------------------------------------------------------ the rounds
    def _loop(self) -> None:
        try:
            while True:
                with self.cv:
                    if self.stopped is not None:
                        return
                    idle = not self.pending and self.joined_at < 0 and not (
                        self.leaving or self.removing)
                    if idle:  # a submit wakes this rank at once; the others, within a cycle
                        self.cv.wait(self._cycle())
                if not self._round() and not idle:
                    time.sleep(CYCLE_S)  # queued names wait for another rank: pace the rounds
        except BaseException as e:  # noqa: BLE001 — MPI failed under us: fail, never hang
            with self.cv:
                if self.stopped is None:
                    self._stop(f"its negotiation failed: {type(e).__name__}: {e}")

    def _cycle(self) -> float:
        return IDLE_CYCLE_S if self._idle_rounds > IDLE_ROUNDS else CYCLE_S

    def _round(self) -> bool:
        """One negotiation round with the other ranks; runs what every rank submitted.
        Returns whether anything ran."""
        with self.cv:
            mine = _Table([] if self.joined_at >= 0 else
                          [(n, r.signature()) for n, r in self.pending.items()],
                          self.joined_at, dict(self.counters) if self.joined_at >= 0 else {},
                          self.blocked > 0, self.leaving, self.removing,
                          self.me == 0 and self._deadlocked())
        tl = _timeline()
        if tl is not None:
            tl.cycle_start()
        tables = self._exchange(mine)
        if tables is None:
            return False
        self.rounds += 1
        return self._decide(tables)

    def _exchange(self, mine: _Table) -> list[_Table] | None:
        """Every rank's table, in set order (None: this rank stops meanwhile). One
        allgather of a fixed slot per rank carries a table that fits (the usual case); when
        any rank's does not, a second, variable-sized allgather carries them all."""
        from .._mpi import MPI  # lazy: initialises MPI; hvd.init() does, not the import
        data = pickle.dumps(mine, pickle.HIGHEST_PROTOCOL)
        n = self.neg.Get_size()
        slot = np.zeros(SLOT, np.uint8)
        fits = len(data) <= SLOT - 8
        slot[:8] = np.frombuffer(np.int64(len(data) if fits else -len(data)).tobytes(), np.uint8)
        if fits:
            slot[8:8 + len(data)] = np.frombuffer(data, np.uint8)
        slots = np.empty((n, SLOT), np.uint8)
        if not self._wait(self.neg.Iallgather(slot, slots), (slot, slots)):
            return None
        sizes = slots[:, :8].copy().view(np.int64).ravel()
        if (sizes >= 0).all():
            return [pickle.loads(slots[i, 8:8 + sizes[i]].tobytes()) for i in range(n)]
        mine_b = np.frombuffer(data, np.uint8)
        counts = np.abs(sizes)
        buf = np.empty(int(counts.sum()), np.uint8)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        if not self._wait(self.neg.Iallgatherv(mine_b, [buf, counts.tolist(), displs, MPI.BYTE]),
                          (mine_b, buf)):
            return None
        return [pickle.loads(buf[d:d + c].tobytes()) for d, c in zip(displs, counts)]

    def _wait(self, request: Any, buffers: tuple) -> bool:
        delay = 2e-5
        while not request.Test():
            if self.stopped is not None:
                _ABANDONED.append((request, buffers))
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return True

    def _decide(self, tables: list[_Table]) -> bool:
        with self.cv:
            try:
                return self._decide_locked(tables)
            finally:
                self.cv.notify_all()

    def _decide_locked(self, tables: list[_Table]) -> bool:
        leaving = [i for i, t in enumerate(tables) if t.leaving]
        active = [i for i, t in enumerate(tables) if t.joined_at < 0]
        by_rank = {i: dict(tables[i].pending) for i in active}
        ready = [n for n, _ in tables[active[0]].pending] if active else []
        ready = [n for n in ready if all(n in by_rank[i] for i in active)]
        joined = [self.ranks[i] for i in range(len(tables)) if i not in active]
        for name in ready:
            self._run_ready(name, [(self.ranks[i], by_rank[i][name]) for i in active], joined)
        if leaving:
            self.gone = self.ranks[leaving[0]]
            self._stop(f"rank {self.gone} shut down")
            return bool(ready)
        if all(t.removing for t in tables):
            self._stop("its process set was removed (hvd.remove_process_set)")
            return bool(ready)
        if not active:
            self._all_joined(tables)
            return True
        self._idle_rounds = 0 if any(t.pending for t in tables) else self._idle_rounds + 1
        stuck = not ready and all(t.blocked for t in tables) and any(t.pending for t in tables)
        self._stuck_since = (self._stuck_since or time.monotonic()) if stuck else None
        if stuck and tables[0].deadlock:
            self._fail_deadlock(tables)
        return bool(ready)

    def _deadlocked(self) -> bool:
        return self._stuck_since is not None and time.monotonic() - self._stuck_since > DEADLOCK_S

    def _all_joined(self, tables: list[_Table]) -> None:
        # Ranks that ran more unnamed collectives before joining continue from the same
        # count as the others, so later unnamed names match again.
        for t in tables:
            for kind, n in t.counters.items():
                self.counters[kind] = max(self.counters.get(kind, 0), n)
        last = max(t.joined_at for t in tables)
        self.join_result = max(self.ranks[i] for i, t in enumerate(tables) if t.joined_at == last)
        self.joined_at = -1

    def _fail_deadlock(self, tables: list[_Table]) -> None:
        waits = "; ".join(f"rank {self.ranks[i]} has " + (
            "joined" if t.joined_at >= 0 else f"{[n for n, _ in t.pending]} pending")
            for i, t in enumerate(tables))
        for req in self.pending.values():
            req.error = HorovodMismatchError(
                req.kind, self.rank,
                f"deadlock: no collective was submitted by every rank ({waits}) for "
                f"{DEADLOCK_S:g} s while every rank waited; every rank must submit the same "
                "names")
            req.done = True
        self.pending.clear()
        self._stuck_since = None

    def _stop(self, why: str) -> None:
        self.stopped = why
        for name, req in self.pending.items():
            req.error = self.stopped_error(req.kind, name)
            req.done = True
        self.pending.clear()
        self.cv.notify_all()

    def _run_ready(self, name: str, sigs: list[tuple[int, tuple]], joined: list[int]) -> None:
        kind, shapes, dtypes, op, root = sigs[0][1]
        problem = compare(name, sigs)
        if problem is None and joined and kind not in ("allreduce", "grouped_allreduce"):
            problem = (f"{kind} {name!r} cannot run while ranks {joined} have joined: "
                       f"{kind} is not supported with join (join covers allreduce, as "
                       "Horovod's)")
        req = None if self.joined_at >= 0 else self.pending.pop(name)
        if problem is not None:
            if req is not None:
                req.error, req.done = HorovodMismatchError(kind, self.rank, problem), True
            return
        tl = _timeline()
        if tl is not None:
            tl.negotiate_end(name, kind, [r for r, _ in sigs])
            tl.op_start(name, kind)
        self.joined_now = bool(joined)  # read by runs that fuse (a stand-in never does)
        if req is None:  # this rank has joined: take part with a neutral tensor
            self._locked(lambda: stand_in(self.comm, shapes, dtypes, op))
        else:
            self._run(req, name)
        if tl is not None:
            tl.op_end(name, kind, _nbytes(shapes, dtypes))

    def _run(self, req: Request, name: str) -> None:
        self.cv.release()  # user threads may submit while the collective runs
        try:
            req.result = self._locked(req.run)
        except CollectiveError as e:
            req.error = e
        except Exception as e:  # noqa: BLE001 — raised by synchronize()
            req.error = HorovodInternalError(req.kind, self.rank, f"{name!r}: {e}")
        finally:
            self.cv.acquire()
        req.done = True

    def _locked(self, fn):
        if self.lock is None:
            return fn()
        with self.lock:
            return fn()


def _nbytes(shapes: tuple, dtypes: tuple) -> int:
    total = 0
    for shape, dt in zip(shapes, dtypes):
        try:
            total += int(np.prod(shape)) * (2 if dt == "bfloat16" else np.dtype(dt).itemsize)
        except TypeError:
            pass
    return total


def stand_in(comm: Any, shapes: tuple, dtypes: tuple, op: str) -> None:
    """A joined rank's part in another rank's allreduce: the op's neutral value."""
    from ..dtypes import BFLOAT16  # lazy: initialises MPI; hvd.init() does, not the import
    for shape, dt in zip(shapes, dtypes):
        dtype = BFLOAT16 if dt == "bfloat16" else np.dtype(dt)
        if _is_bf16(np.zeros(0, dtype)):
            dtype = np.dtype(np.float32)  # as np_allreduce sends it
        if op == Average and dtype.kind in "iub":
            op = Sum  # as np_allreduce sends it
        comm.allreduce(np.full(shape, neutral(dtype, op), dtype), op=op, inplace=True)
