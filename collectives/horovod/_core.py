"""The framework-free half of collectives.horovod: start-up, topology, the reduction ops,
the unsupported-API errors, and the engine that matches collectives by name.

Horovod keys every collective by its name (``allreduce(t, name="loss")``; unnamed ones get
``allreduce.noname.<n>``, counted per operation): a collective runs once every rank has
submitted that name, whatever order the ranks submitted in, and a name whose shapes or
dtypes differ across ranks is an error naming the ranks. The engine here does the same
without a background thread. ``*_async`` calls queue a request and return a handle;
``synchronize(handle)`` (and every blocking call, which is ``synchronize(*_async(...))``)
runs negotiation rounds: every rank that is waiting exchanges the list of names it has
queued (one small allgather on a private duplicate of the world communicator), and each
name queued on every rank runs, in the order the lowest-numbered rank queued them, on
the runtime's collectives. A round where no name is ready and every rank is blocked is a
deadlock: it raises on every rank, naming what each waits for. A rank that shuts down
(``shutdown()``, or the end of its program) tells the others (``_farewell.py``): their
pending and later collectives fail with Horovod's "Horovod has been shut down", naming it.

Standard library and NumPy only at import; MPI starts in ``init()``.
"""

from __future__ import annotations

import atexit
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import objects as _objects
from .._queries import query
from ..errors import CollectiveError, MismatchError
from ._arrays import OP_NAMES as _OP_NAMES
from ._arrays import OPS as _OPS
from ._arrays import (Average, Max, Min, Product, Sum, _is_bf16, bits,  # noqa: F401 (re-exported)
                      neutral, np_allgather, np_allreduce, np_alltoall, np_reducescatter,
                      split_rows)
from ._farewell import Farewells

# The framework-neutral API: each framework module re-exports it (``from .._core import *``).
__all__ = [
    "Average", "Sum", "Min", "Max", "Product", "HorovodInternalError", "HorovodMismatchError",
    "HorovodUnsupportedError", "global_process_set", "shutdown", "is_initialized", "size",
    "rank", "local_size", "local_rank", "cross_size", "cross_rank", "is_homogeneous",
    "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
    "ddl_built", "ccl_built", "rocm_built", "barrier",
]



class HorovodInternalError(CollectiveError, RuntimeError):
    """A collective failed (Horovod's exception name, so ``except`` clauses keep working)."""


class HorovodMismatchError(MismatchError):
    """Ranks submitted the same name with different shapes, dtypes, ops or roots."""


class HorovodUnsupportedError(CollectiveError, NotImplementedError, AttributeError):
    """Horovod API that dtrun does not provide. An AttributeError too, so ``hasattr`` and
    ``getattr(hvd, name, default)`` feature probes see it as absent."""

    def __init__(self, name: str, instead: str):
        super().__init__(name, None, f"not provided by collectives.horovod; {instead}")

    def __str__(self) -> str:  # one line, without the "rank ?" of runtime errors
        return f"{self.op}: {self.problem}"


_ELASTIC = ("use `dtrun --max-restarts N` to restart the job after a failure, with "
            "dtrun.collectives.dp.save_checkpoint/load_checkpoint to resume from the last checkpoint")
_PROCESS_SETS = ("collectives run over all ranks; for a subset build a sub-communicator "
                 "with collectives.init().split(color)")
UNSUPPORTED: dict[str, str] = {
    "Adasum": "use op=Average (the default) or op=Sum",
    "elastic": _ELASTIC,
    "ProcessSet": _PROCESS_SETS,
    "add_process_set": _PROCESS_SETS,
    "remove_process_set": _PROCESS_SETS,
    "start_timeline": "dtrun's flight recorder (collectives/recorder.py) records every "
                      "collective; use torch.profiler or tf.profiler for timelines",
    "stop_timeline": "see start_timeline",
    "sparse_allreduce_async": "reduce the dense gradient (DistributedOptimizer does: "
                              "sparse_as_dense)",
    "ddl_built": None, "ccl_built": None,  # answered below, never unsupported
}
UNSUPPORTED = {k: v for k, v in UNSUPPORTED.items() if v is not None}


def unsupported(name: str) -> HorovodUnsupportedError:
    return HorovodUnsupportedError(name, UNSUPPORTED[name])


class _GlobalProcessSet:
    """Horovod's default ``process_set`` argument: all ranks (the only set dtrun has)."""

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = _GlobalProcessSet()


def check_process_set(process_set: Any, op: str) -> None:
    if process_set is not global_process_set and process_set is not None:
        raise HorovodUnsupportedError(f"{op}(process_set=...)", _PROCESS_SETS)


def check_op(op: Any, where: str, allowed: tuple = _OPS) -> str:
    """Horovod's op argument (None means Average) as a runtime op name."""
    if op is None:
        return Average
    if isinstance(op, str) and op.lower() == "adasum":
        raise unsupported("Adasum")
    if op not in allowed:
        names = ", ".join(_OP_NAMES[o] for o in allowed)
        raise CollectiveError(where, None, f"op={op!r} is not one of {names}")
    return op


def op_from_average(op: Any, average: Any, where: str) -> str:
    """Horovod's deprecated ``average=`` argument, folded into ``op``."""
    if average is not None:
        if op is not None:
            raise CollectiveError(where, None, "pass op= or the deprecated average=, not both")
        return Average if average else Sum
    return check_op(op, where)


# ----------------------------------------------------------------------------- the job
@dataclass
class Job:
    comm: Any            # collectives.Comm the collectives run on
    neg: Any             # mpi4py communicator for negotiation (private duplicate)
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    engine: "Engine" = field(repr=False, default=None)
    farewells: Any = field(repr=False, default=None)  # _farewell.Farewells


_JOB: Job | None = None
_AT_EXIT: list = []  # shutdown() registered with atexit (once), as Horovod's init does


def init(comm: Any = None, lock: Any = None) -> Job:
    """Start (or join) the job. ``comm``: the collectives.Comm to run on (default: the
    world). ``lock``: held around every collective (collectives.dp's, where its
    background thread shares the communicator). Calling it again returns the same job."""
    global _JOB
    if _JOB is not None:
        return _JOB
    if comm is None:
        from .. import comm as _comm
        comm = _comm.init()
    neg = comm.mpi.Dup()
    _JOB = Job(comm, neg, comm.rank, comm.size, comm.local_rank, comm.local_size,
               comm.node, comm.nnodes)
    _JOB.engine = Engine(_JOB, lock)
    _JOB.farewells = Farewells(comm.mpi)
    if not _AT_EXIT:
        _AT_EXIT.append(atexit.register(shutdown))
    return _JOB


def job(op: str) -> Job:
    if _JOB is None:
        raise ValueError(f"{op}: Horovod has not been initialized; use hvd.init().")
    return _JOB


def is_initialized() -> bool:
    return _JOB is not None


def shutdown() -> None:
    """Leave the job: tell the other ranks (their pending and later collectives fail with
    "Horovod has been shut down"), fail this rank's pending ones, forget the job. MPI
    stays up until the process exits. Runs at exit too, as Horovod's."""
    global _JOB
    if _JOB is not None:
        j, _JOB = _JOB, None
        j.farewells.announce(j.rank, j.engine.exchanges)
        j.engine.fail_pending("this rank shut down (hvd.shutdown()) before it ran")


def mpi_threads_supported() -> bool:
    from .._mpi import MPI
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def built_flags() -> dict[str, bool]:
    """Horovod's ``*_built`` / ``*_enabled`` queries, answered for dtrun: collectives go
    over MPI (always), NCCL where CuPy's NCCL is importable; never Gloo, DDL, oneCCL, ROCm."""
    import importlib.util
    nccl = importlib.util.find_spec("cupy") is not None
    return {"mpi_built": True, "mpi_enabled": True, "gloo_built": False, "gloo_enabled": False,
            "nccl_built": nccl, "ddl_built": False, "ccl_built": False, "cuda_built": nccl,
            "rocm_built": False}


_FLAGS: dict[str, bool] = {}


def flag(name: str) -> bool:
    """One of ``built_flags()`` (read once, on the first query)."""
    if not _FLAGS:
        _FLAGS.update(built_flags())
    return _FLAGS[name]


# The queries whose answer is the same for every framework (nccl_built and cuda_built
# depend on the framework's device support: each module answers those).
def mpi_built() -> bool: return flag("mpi_built")  # noqa: E704
def mpi_enabled() -> bool: return flag("mpi_enabled")  # noqa: E704
def gloo_built() -> bool: return flag("gloo_built")  # noqa: E704
def gloo_enabled() -> bool: return flag("gloo_enabled")  # noqa: E704
def ddl_built() -> bool: return flag("ddl_built")  # noqa: E704
def ccl_built() -> bool: return flag("ccl_built")  # noqa: E704
def rocm_built() -> bool: return flag("rocm_built")  # noqa: E704


# ----------------------------------------------------------------------------- topology
size = query(job, "size", "Number of ranks in the job.")
rank = query(job, "rank", "This process's rank.")
local_size = query(job, "local_size", "Number of ranks on this host.")
local_rank = query(job, "local_rank", "This process's rank among the ranks on its host.")
cross_size = query(job, "cross_size",
                   "Number of hosts (Horovod: ranks with this local rank across hosts).")
cross_rank = query(job, "cross_rank", "Index of this host among the job's hosts.")


def is_homogeneous() -> bool:
    j = job("is_homogeneous")
    return j.local_size * j.cross_size == j.size


def check_init_args(comm: Any, process_sets: Any) -> None:
    """Horovod's ``init(comm=[ranks])`` subsets and ``process_sets`` are not provided; a
    ``collectives.Comm`` may be passed as ``comm``."""
    if process_sets is not None:
        raise HorovodUnsupportedError("init(process_sets=...)", _PROCESS_SETS)
    if comm is not None and not hasattr(comm, "allreduce"):
        raise HorovodUnsupportedError("init(comm=[ranks])", _PROCESS_SETS)


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank gets here."""
    check_process_set(process_set, "barrier")
    j = job("barrier")
    j.engine.run("barrier", None, j.comm.barrier)


# ----------------------------------------------------------------------------- requests
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
    stand_in: Callable[[tuple], Any] | None = None
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


_VARIABLE_FIRST_DIM = ("allgather", "alltoall")
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
        if sig[0] != kind:
            return f"{name!r} is {sig[0]} on rank {r} but {kind} on rank {r0}"
        if len(sig[1]) != len(ref[1]):
            return (f"{kind} {name!r} has {len(sig[1])} tensors on rank {r} but "
                    f"{len(ref[1])} on rank {r0}")
        for i, (shape, rshape) in enumerate(zip(sig[1], ref[1])):
            what = f"{kind} {name!r}" + (f" tensor {i}" if len(ref[1]) > 1 else "")
            if sig[2][i] != ref[2][i]:
                return f"{what} is {sig[2][i]} on rank {r} but {ref[2][i]} on rank {r0}"
            if kind in _VARIABLE_FIRST_DIM:
                if len(shape) != len(rshape) or tuple(shape[1:]) != tuple(rshape[1:]):
                    return (f"{what} has shape {tuple(shape)} on rank {r} but {tuple(rshape)} "
                            f"on rank {r0}; only the first dimension may differ")
            elif tuple(shape) != tuple(rshape):
                return (f"{what} has shape {tuple(shape)} on rank {r} but {tuple(rshape)} "
                        f"on rank {r0}")
        if sig[3] != ref[3]:
            return (f"{kind} {name!r} uses op {_OP_NAMES.get(sig[3], sig[3])} on rank {r} but "
                    f"{_OP_NAMES.get(ref[3], ref[3])} on rank {r0}")
        if sig[4] != ref[4]:
            return f"{kind} {name!r} has root_rank {sig[4]} on rank {r} but {ref[4]} on rank {r0}"
    return None


class Engine:
    """Queues requests and runs them once every rank has submitted the same name."""

    def __init__(self, job_: Job, lock: Any = None):
        self.job = job_
        self.lock = lock
        # One thread at a time submits or negotiates (tf.py_function bodies can run on
        # TensorFlow's threads).
        self.mutex = threading.RLock()
        self.pending: dict[str, Request] = {}  # insertion order = submission order
        self.counters: dict[str, int] = {}
        self.joined = False
        self.in_flight: tuple | None = None  # the buffers of the negotiation under way
        self.exchanges = 0  # negotiation exchanges started (the same count on every rank)

    def name(self, kind: str, name: str | None) -> str:
        if name is not None:
            return str(name)
        n = self.counters.get(kind, 0)
        self.counters[kind] = n + 1
        return f"{kind}.noname.{n}"

    def submit(self, req: Request) -> Handle:
        with self.mutex:
            return self._submit(req)

    def _submit(self, req: Request) -> Handle:
        if self.job.farewells.check(self.exchanges) is not None:
            raise self.shut_down_error(req.kind, req.name)
        if req.name in self.pending:
            raise CollectiveError(req.kind, self.job.rank,
                                  f"a collective named {req.name!r} is already pending on this "
                                  "rank; synchronize it first or use another name")
        self.pending[req.name] = req
        return Handle(req)

    # -- rounds
    def run(self, kind: str, name: str | None, fn: Callable[[], Any], root: int = -1) -> Any:
        """``fn``, a collective with no tensor to compare (barrier, the object
        collectives), run as a named request: matched, and failed, like the others."""
        req = Request(kind, self.name(kind, name), (), (), "", root, fn)
        return self.synchronize(self.submit(req))

    def shut_down_error(self, kind: str, name: str) -> HorovodInternalError:
        """Horovod's error for a collective that cannot run: a rank shut down."""
        r = self.job.farewells.gone
        return HorovodInternalError(
            kind, self.job.rank,
            f"Horovod has been shut down: rank {r} shut down (hvd.shutdown(), or its program "
            f"ended) without running {name!r}. This was caused by an exception on rank {r} or "
            f"an attempt to run a collective after rank {r} finished execution; see rank "
            f"{r}'s output")

    def fail_pending(self, why: str | None = None) -> None:
        """Every pending request fails: a rank shut down (``why``: this one did)."""
        for name, req in self.pending.items():
            req.error = (HorovodInternalError(req.kind, self.job.rank,
                                              f"Horovod has been shut down: {why}")
                         if why else self.shut_down_error(req.kind, name))
            req.done = True
        self.pending.clear()

    def _exchange(self, mine: Any) -> list | None:
        """Every rank's ``mine``, in rank order: an allgather on the negotiation
        communicator that also watches for a rank's shutdown (then None)."""
        from .._mpi import MPI
        neg, fw = self.job.neg, self.job.farewells
        data = np.frombuffer(pickle.dumps(mine, pickle.HIGHEST_PROTOCOL), np.uint8)
        mine_n, counts = np.array([data.size], np.int64), np.zeros(self.job.size, np.int64)
        self.in_flight = (data, mine_n, counts)  # MPI's until the request completes
        self.exchanges += 1
        if fw.wait(neg.Iallgather(mine_n, counts), self.exchanges - 1) is not None:
            return None
        buf = np.empty(int(counts.sum()), np.uint8)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        self.in_flight = (data, buf)
        self.exchanges += 1
        if fw.wait(neg.Iallgatherv(data, [buf, counts.tolist(), displs, MPI.BYTE]),
                   self.exchanges - 1) is not None:
            return None
        self.in_flight = None
        return [pickle.loads(buf[d:d + c].tobytes()) for d, c in zip(displs, counts)]

    def _round(self, blocking: bool) -> bool:
        """One negotiation round with every other rank; runs what every rank submitted.
        Returns True once every rank has joined. A rank's shutdown fails what is pending."""
        job_ = self.job
        mine = [] if self.joined else [(n, r.signature()) for n, r in self.pending.items()]
        tables = self._exchange((self.joined, blocking, mine,
                                 self.counters if self.joined else None))
        if tables is None:
            self.fail_pending()
            return False
        active = [i for i, t in enumerate(tables) if not t[0]]
        if not active:
            self._all_joined = [t[0] for t in tables]
            # Ranks that ran more unnamed collectives before joining continue from the
            # same count as the others, so later unnamed names match again.
            for t in tables:
                for kind, n in t[3].items():
                    self.counters[kind] = max(self.counters.get(kind, 0), n)
            return True
        by_rank = {i: dict(tables[i][2]) for i in active}
        ready = [n for n, _ in tables[active[0]][2] if all(n in by_rank[i] for i in active)]
        joined = [i for i in range(job_.size) if i not in active]
        for name in ready:
            self._run_ready(name, [(i, by_rank[i][name]) for i in active], joined)
        if not ready and all(t[1] for t in tables):
            waits = "; ".join(f"rank {i} has " + ("joined" if tables[i][0] else
                                                  f"{[n for n, _ in tables[i][2]]} pending")
                              for i in range(job_.size))
            raise HorovodMismatchError(
                "synchronize", job_.rank,
                f"deadlock: no collective was submitted by every rank ({waits}); every rank "
                "must submit the same names")
        return False

    def _run_ready(self, name: str, sigs: list[tuple[int, tuple]], joined: list[int]) -> None:
        job_ = self.job
        kind, shapes, dtypes, op, root = sigs[0][1]
        problem = compare(name, sigs)
        if problem is None and joined and kind not in ("allreduce", "grouped_allreduce",
                                                       "broadcast"):
            problem = (f"{kind} {name!r} cannot run while ranks {joined} have joined "
                       "(join covers allreduce and broadcast, as Horovod's)")
        if problem is None and joined and root in joined:
            problem = f"broadcast {name!r} has root_rank {root}, which has joined"
        req = None if self.joined else self.pending.pop(name)
        if problem is not None:
            if req is not None:
                req.error, req.done = HorovodMismatchError(kind, job_.rank, problem), True
            return
        if req is None:  # this rank has joined: take part with a neutral tensor
            self._locked(lambda: stand_in(job_.comm, kind, shapes, dtypes, op, root))
            return
        try:
            req.result = self._locked(req.run)
        except CollectiveError as e:
            req.error = e
        except Exception as e:  # noqa: BLE001 — raised by synchronize()
            req.error = HorovodInternalError(kind, job_.rank, f"{name!r}: {e}")
        req.done = True

    def _locked(self, fn):
        if self.lock is None:
            return fn()
        with self.lock:
            return fn()

    def synchronize(self, handle: Handle) -> Any:
        req = handle.request
        with self.mutex:
            while not req.done:
                self._round(blocking=True)
        if req.error is not None:
            raise req.error
        return req.result

    def poll(self, handle: Handle) -> bool:
        """Done yet? A pending handle takes part in one round (which waits for the others)."""
        req = handle.request
        with self.mutex:
            if not req.done:
                self._round(blocking=False)
        return req.done

    def join(self) -> int:
        """Take part in the other ranks' allreduces and broadcasts with neutral tensors
        until every rank has joined; return the rank that joined last."""
        rounds = 0
        self.mutex.acquire()
        try:
            while True:
                rounds += 1
                self.joined = rounds  # rounds spent joined: the last to join has the fewest
                if self.job.farewells.gone is not None:
                    raise self.shut_down_error("join", "join")
                if self._round(blocking=True):
                    counts = self._all_joined
                    fewest = min(counts)
                    return max(i for i, c in enumerate(counts) if c == fewest)
        finally:
            self.joined = False
            self.mutex.release()



def stand_in(comm: Any, kind: str, shapes: tuple, dtypes: tuple, op: str, root: int) -> None:
    """A joined rank's part in another rank's allreduce or broadcast."""
    from ..dtypes import BFLOAT16
    for shape, dt in zip(shapes, dtypes):
        dtype = BFLOAT16 if dt == "bfloat16" else np.dtype(dt)
        if kind == "broadcast":
            comm.broadcast(bits(np.zeros(shape, dtype)), root=root, inplace=True)
        else:
            if _is_bf16(np.zeros(0, dtype)):
                dtype = np.dtype(np.float32)  # as np_allreduce sends it
            if op == Average and dtype.kind in "iub":
                op = Sum  # as np_allreduce sends it
            comm.allreduce(np.full(shape, neutral(dtype, op), dtype), op=op, inplace=True)


# ----------------------------------------------------------------------------- objects
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Root's picklable ``obj`` on every rank."""
    j = job("broadcast_object")
    if not 0 <= int(root_rank) < j.size:
        raise ValueError(f"broadcast_object: root_rank {root_rank} is not a rank of this job "
                         f"(0..{j.size - 1})")
    return j.engine.run("broadcast_object", name, lambda: _objects.broadcast_object(
        j.comm, obj, int(root_rank)), root=int(root_rank))


def allgather_object(obj: Any, name: str | None = None) -> list:
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    j = job("allgather_object")
    return j.engine.run("allgather_object", name,
                        lambda: _objects.allgather_objects(j.comm, obj))
