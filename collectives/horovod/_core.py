"""The framework-free half of collectives.horovod: start-up, topology, process sets, the
reduction ops, the unsupported-API errors and the object collectives. Collectives are
matched by name, in the background, by ``_engine.Engine`` (one per process set).

Standard library and NumPy only at import; MPI starts in ``init()``.
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np  # noqa: F401 (framework modules reach NumPy through here)

from .. import objects as _objects
from . import _timeline
from .._queries import query
from ..errors import CollectiveError
from ._arrays import OP_NAMES as _OP_NAMES
from ._arrays import OPS as _OPS
from ._arrays import (Average, Max, Min, Product, Sum, _is_bf16, bits,  # noqa: F401 (re-exported)
                      neutral, np_allgather, np_allreduce, np_alltoall, np_reducescatter,
                      split_rows)
from ._engine import (NOT_A_TENSOR, DuplicateNameError, Engine, Handle,  # noqa: F401
                      HorovodInternalError, HorovodMismatchError, HostsUpdatedInterrupt, Request,
                      compare)

# The framework-neutral API: each framework module re-exports it (``from .._core import *``).
__all__ = [
    "Average", "Sum", "Min", "Max", "Product", "HorovodInternalError", "HorovodMismatchError",
    "HostsUpdatedInterrupt",
    "HorovodUnsupportedError", "global_process_set", "shutdown", "is_initialized", "size",
    "rank", "local_size", "local_rank", "cross_size", "cross_rank", "is_homogeneous",
    "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
    "ddl_built", "ccl_built", "rocm_built", "barrier", "ProcessSet", "add_process_set",
    "remove_process_set", "Adasum", "DuplicateNameError", "start_timeline", "stop_timeline",
]



class HorovodUnsupportedError(CollectiveError, NotImplementedError, AttributeError):
    """Horovod API that dtrun does not provide. An AttributeError too, so ``hasattr`` and
    ``getattr(hvd, name, default)`` feature probes see it as absent."""

    def __init__(self, name: str, instead: str):
        super().__init__(name, None, f"not provided by collectives.horovod; {instead}")

    def __str__(self) -> str:  # one line, without the "rank ?" of runtime errors
        return f"{self.op}: {self.problem}"


# Horovod API names dtrun does not provide, each with what to use instead (none today).
UNSUPPORTED: dict[str, str] = {}
Adasum = "adasum"  # Horovod's op constant; the op of allreduce and DistributedOptimizer


def unsupported(name: str) -> HorovodUnsupportedError:
    return HorovodUnsupportedError(name, UNSUPPORTED[name])


def check_op(op: Any, where: str, allowed: tuple = _OPS) -> str:
    """Horovod's op argument (None means Average) as a runtime op name (or Adasum)."""
    if op is None:
        return Average
    if isinstance(op, str) and op.lower() == Adasum:
        if Adasum not in allowed:
            raise ValueError(f"{where}: op=Adasum is not supported here (allreduce and "
                             "DistributedOptimizer take it)")
        return Adasum
    if op not in allowed:
        names = ", ".join(_OP_NAMES.get(o, o) for o in allowed)
        raise ValueError(f"{where}: op={op!r} is not one of {names}")
    return op


def op_from_average(op: Any, average: Any, where: str) -> str:
    """Horovod's deprecated ``average=`` argument, folded into ``op``."""
    if average is not None:
        if op is not None:
            raise CollectiveError(where, None, "pass op= or the deprecated average=, not both")
        return Average if average else Sum
    return check_op(op, where)


# ----------------------------------------------------------------------------- process sets
class ProcessSet:
    """Horovod's process set: a subset of the job's ranks that runs collectives of its
    own (``process_set=`` on every collective). Registered by ``add_process_set`` (or
    ``init(process_sets=[...])``), on every rank of the job in the same order."""

    def __init__(self, ranks_or_comm: Any):
        if hasattr(ranks_or_comm, "Get_group") or hasattr(ranks_or_comm, "mpi"):
            mpi = getattr(ranks_or_comm, "mpi", ranks_or_comm)
            from .._mpi import MPI  # lazy: initialises MPI; hvd.init() does, not the import
            ranks_or_comm = MPI.Group.Translate_ranks(
                mpi.Get_group(), list(range(mpi.Get_size())), MPI.COMM_WORLD.Get_group())
        self.ranks = sorted({int(r) for r in ranks_or_comm})
        self.process_set_id: int | None = None

    def size(self) -> int | None:
        return None if self.process_set_id is None else len(self._scope_ranks())

    def rank(self) -> int | None:
        """This rank's index in the set (None: not registered, or not a member)."""
        if self.process_set_id is None:
            return None
        ranks = self._scope_ranks()
        me = job("ProcessSet.rank").rank
        return ranks.index(me) if me in ranks else None

    def included(self) -> bool | None:
        if self.process_set_id is None:
            return None
        return job("ProcessSet.included").rank in self._scope_ranks()

    def _scope_ranks(self) -> list[int]:
        return self.ranks or list(range(job("ProcessSet").size))

    def __repr__(self) -> str:
        ranks = "all ranks" if self is global_process_set else self.ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclass
class Scope:
    """What a collective on one process set runs with."""

    comm: Any            # collectives.Comm over the set's ranks
    engine: Engine
    ranks: list[int]     # the set's global ranks, sorted
    rank: int            # this rank's index in the set
    size: int


@dataclass
class Job:
    comm: Any            # collectives.Comm the global set's collectives run on
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    engine: Engine = field(repr=False, default=None)
    sets: dict = field(repr=False, default_factory=dict)  # id -> Scope (members) or None
    set_ranks: dict = field(repr=False, default_factory=dict)  # id -> the set's ranks (all ranks know)
    next_id: int = 1
    threaded: bool = True
    lock: Any = None


_JOB: Job | None = None
_AT_EXIT: list = []  # shutdown() registered with atexit (once), as Horovod's init does
_INIT_LOCK = threading.Lock()


def init(comm: Any = None, lock: Any = None, process_sets: Sequence | None = None) -> Job:
    """Start (or join) the job. ``comm``: the collectives.Comm the background thread runs
    the collectives on (default: a duplicate of the world; one given here must not be used
    by the program at the same time). ``lock``: held around every collective where MPI is not thread-safe
    (collectives.dp's, whose background thread shares MPI). Calling it again returns
    the same job at once. ``process_sets``: registered after start-up, in order."""
    global _JOB
    with _INIT_LOCK:
        if _JOB is None:
            if comm is None:  # a communicator of its own: its thread never meets the user's calls
                from .. import comm as _comm  # lazy: initialises MPI; hvd.init() does, not the import
                comm = _comm.init().split(0)
            from .._mpi import MPI  # lazy: initialises MPI; hvd.init() does, not the import
            threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
            j = Job(comm, comm.rank, comm.size, comm.local_rank, comm.local_size,
                    comm.node, comm.nnodes, threaded=threaded, lock=None if threaded else lock)
            j.engine = Engine(comm, list(range(comm.size)), threaded, j.lock, "global")
            j.sets[0] = Scope(comm, j.engine, list(range(comm.size)), comm.rank, comm.size)
            _JOB = j
            if not _AT_EXIT:
                _AT_EXIT.append(atexit.register(shutdown))
            _timeline.attach(j.rank, j.size, j.comm, lock=j.lock)
        j = _JOB
    for ps in process_sets or ():
        add_process_set(ps)
    return j


def job(op: str) -> Job:
    if _JOB is None:
        raise ValueError(f"{op}: Horovod has not been initialized; use hvd.init().")
    return _JOB


def is_initialized() -> bool:
    return _JOB is not None


def shutdown() -> None:
    """Leave the job: every engine says so in its next round (the other ranks' pending
    and later collectives fail with "Horovod has been shut down"), this rank's pending
    ones fail, the job is forgotten. MPI stays up until the process exits. Runs at exit
    too, as Horovod's."""
    global _JOB
    with _INIT_LOCK:
        j, _JOB = _JOB, None
    if j is None:
        return
    for sid, sc in sorted(j.sets.items(), reverse=True):
        if sc is not None:
            sc.engine.stop()
    _timeline.detach()  # after the engines: a rank still negotiating is not kept waiting


def scope(process_set: Any, op: str) -> Scope:
    """The comm and engine of ``process_set`` (None: every rank) for the collective ``op``."""
    j = job(op)
    if process_set is None or process_set is global_process_set:
        return j.sets[0]
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{op}: process_set={process_set!r} is not a hvd.ProcessSet")
    sid = process_set.process_set_id
    if sid is None or sid not in j.sets:
        raise ValueError(f"{op}: {process_set!r} is not registered (hvd.add_process_set), or "
                         "was removed")
    sc = j.sets[sid]
    if sc is None:
        raise ValueError(f"{op}: rank {j.rank} is not in {process_set!r}")
    return sc


def process_set_ranks(sid: int, op: str) -> list[int]:
    """The ranks of the process set numbered ``sid`` (0: every rank), known on every rank,
    members or not."""
    j = job(op)
    if sid == 0:
        return list(range(j.size))
    if sid not in j.set_ranks:
        raise ValueError(f"{op}: process set {sid} is not registered (hvd.add_process_set)")
    return list(j.set_ranks[sid])


def add_process_set(process_set: Any) -> ProcessSet:
    """Register ``process_set`` (a ProcessSet or a list of ranks) on every rank of the job
    (collective: every rank calls it with the same ranks, in the same order)."""
    j = job("add_process_set")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"add_process_set: {ps!r} is already registered")
    if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= j.size:
        raise ValueError(f"add_process_set: ranks {ps.ranks} must be ranks of this job "
                         f"(0..{j.size - 1})")
    for sid, ranks in j.set_ranks.items():
        if ranks == ps.ranks:
            raise ValueError(f"add_process_set: a process set with ranks {ps.ranks} is "
                             f"already registered (id {sid})")

    def register():
        member = j.rank in ps.ranks
        sub = j.comm.split(1 if member else None, key=j.rank)
        sid = j.next_id
        j.next_id += 1
        j.sets[sid] = None if sub is None else Scope(
            sub, Engine(sub, ps.ranks, j.threaded, j.lock, f"set{sid}"), list(ps.ranks),
            ps.ranks.index(j.rank), len(ps.ranks))
        j.set_ranks[sid] = list(ps.ranks)
        return sid
    name = f"add_process_set.{j.next_id}"
    req = Request("add_process_set", name, (tuple(ps.ranks),), ("ranks",), "", -1, register)
    ps.process_set_id = j.engine.synchronize(j.engine.submit(req))
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (collective, as add_process_set). Its
    pending collectives fail. Returns False when it was not registered."""
    j = job("remove_process_set")
    sid = getattr(process_set, "process_set_id", None)
    if not sid or sid not in j.sets:
        return False

    def unregister():
        sc = j.sets.pop(sid)
        j.set_ranks.pop(sid, None)
        if sc is not None:
            sc.engine.stop(removing=True)
            sc.comm.free()
        return True
    req = Request("remove_process_set", f"remove_process_set.{sid}", ((sid,),), ("id",), "",
                  -1, unregister)
    j.engine.synchronize(j.engine.submit(req))
    process_set.process_set_id = None
    return True


def mpi_threads_supported() -> bool:
    from .._mpi import MPI  # lazy: initialises MPI; hvd.init() does, not the import
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
    """Horovod's ``init(comm=[ranks])`` subsets are not provided (a ``collectives.Comm``
    may be passed as ``comm``); ``process_sets`` must be ProcessSets or lists of ranks."""
    if comm is not None and not hasattr(comm, "allreduce"):
        raise HorovodUnsupportedError(
            "init(comm=[ranks])", "run the job on the ranks you need (dtrun -np N), or use "
            "hvd.add_process_set(ranks) for collectives over a subset")
    if process_sets is not None and not isinstance(process_sets, (list, tuple)):
        raise ValueError("init(process_sets=...): expected a list of hvd.ProcessSet")


def check_process_set(process_set: Any, op: str) -> Scope:
    """The scope of ``process_set`` (raises ValueError naming ``op`` when unusable)."""
    return scope(process_set, op)


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank of the set gets here."""
    sc = scope(process_set, "barrier")
    sc.engine.run("barrier", None, sc.comm.barrier)


# ----------------------------------------------------------------------------- timeline
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write a Chrome trace of every rank's collectives to ``file_path`` (Horovod's)."""
    job("start_timeline")
    _timeline.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline and close its file."""
    job("stop_timeline")
    _timeline.stop_timeline()


# ----------------------------------------------------------------------------- objects
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """Root's picklable ``obj`` on every rank of the set (``root_rank``: a job rank)."""
    sc = scope(process_set, "broadcast_object")
    root = set_root(sc, root_rank, "broadcast_object")
    return sc.engine.run("broadcast_object", name, lambda: _objects.broadcast_object(
        sc.comm, obj, root), root=int(root_rank))


def allgather_object(obj: Any, name: str | None = None,
                     process_set: Any = global_process_set) -> list:
    """Every rank's picklable ``obj``, in rank order, on every rank of the set."""
    sc = scope(process_set, "allgather_object")
    return sc.engine.run("allgather_object", name,
                         lambda: _objects.allgather_objects(sc.comm, obj))


def set_root(sc: Scope, root_rank: Any, op: str) -> int:
    """``root_rank`` (a job rank, as Horovod's) as an index into the set's comm."""
    r = int(root_rank)
    if r not in sc.ranks:
        what = "this job" if len(sc.ranks) == job(op).size else f"the process set {sc.ranks}"
        raise ValueError(f"{op}: root_rank {root_rank} is not a rank of {what} "
                         f"(0..{job(op).size - 1})" if what == "this job" else
                         f"{op}: root_rank {root_rank} is not a rank of {what}")
    return sc.ranks.index(r)
