"""The job as ``collectives.dp`` sees it: the context ``init()`` returns, the lock, dp's errors.

Every part of ``collectives.dp`` starts from here: the public helpers in ``dp``, the
optimizer in ``dp_optimizer`` and its sparse gathers in ``dp_sparse``. It also holds the
one cross-rank check they share: that every rank passed the same parameters (names,
shapes, dtypes), raised as ParameterMismatchError naming the first difference. Separate
so that those modules depend on it and not on each other.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch

from . import objects as _objects
from ._queries import query
from .errors import CollectiveError, MismatchError

AVG, SUM = "avg", "sum"


class NotInitializedError(CollectiveError, RuntimeError):
    """A collectives.dp function was called before ``init()``."""


class ParameterMismatchError(MismatchError):
    """The ranks built different parameter sets (names, shapes or dtypes)."""


class UsageError(CollectiveError, ValueError):
    """An argument of a collectives.dp function that cannot work (checked locally)."""


@dataclass(frozen=True)
class Context:
    """What ``init()`` returns: this rank's place in the job and its device."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    comm: Any  # collectives.Comm


_CTX: Context | None = None
# One thread at a time inside the runtime: the optimizer's background thread holds it
# for each bucket, the functions of collectives.dp for their collectives. Comm objects keep
# per-call state (the shared-memory window), so two threads must not share one at once.
LOCK = threading.RLock()


def init(comm: Any = None) -> Context:
    """Start (or join) the job; return rank, size, local rank and this rank's device.

    The device is ``cuda:{local_rank % device_count}`` when CUDA is available (made
    current with ``torch.cuda.set_device``), else ``cpu``. Calling it again returns
    the same context. Collective on first call.
    """
    global _CTX
    if _CTX is not None:
        return _CTX
    if comm is None:
        ours = "mpi4py.MPI" not in sys.modules and "OMPI_MCA_mpi_yield_when_idle" not in os.environ
        if ours:
            # Open MPI busy-polls while it waits. Here the allreduce thread waits beside
            # the compute threads (and, on a host with more ranks than free cores, other
            # ranks): a waiting rank should give its core away, or it slows the very
            # threads it waits for (benchmarks/bench_ddp.py measures both settings on a
            # loaded host). Read at MPI_Init (importing mpi4py.MPI); a user's setting wins.
            os.environ["OMPI_MCA_mpi_yield_when_idle"] = "1"
        try:
            from . import comm as _comm  # lazy: initialises MPI, which must see the setting above
            comm = _comm.init()
        finally:
            if ours:
                os.environ.pop("OMPI_MCA_mpi_yield_when_idle", None)  # not for child processes
    device = torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    _CTX = Context(comm.rank, comm.size, comm.local_rank, comm.local_size, device, comm)
    return _CTX


def current(op: str) -> Context:
    """The context ``init()`` made; NotInitializedError naming ``op`` before it."""
    if _CTX is None:
        raise NotInitializedError(op, None, "called before init(); call collectives.dp.init() "
                                  "first (once per process, after the launcher started it)")
    return _CTX


rank = query(current, "rank", "This process's rank.")
size = query(current, "size", "Number of ranks in the job.")
local_rank = query(current, "local_rank", "This process's rank among the ranks on its host.")


def allgather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    return _objects.allgather_objects(current("allgather").comm, obj, lock=LOCK)


# ---------------------------------------------------------------- parameter checks
def signature(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple, str]]:
    return [(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in named]


def check_same(named: list[tuple[str, torch.Tensor]], op: str) -> None:
    """Raise ParameterMismatchError on every rank if the ranks' tensor lists differ."""
    ctx = current(op)
    if ctx.size == 1:
        return
    mine = signature(named)
    tables = allgather_objects(mine)
    problem = first_difference(tables)
    if problem:
        raise ParameterMismatchError(op, ctx.rank, problem + "; every rank must build the same "
                                     "model and pass the same parameters")


def first_difference(tables: list[list[tuple[str, tuple, str]]]) -> str | None:
    """Describe the first way any rank's (name, shape, dtype) list differs from rank 0's."""
    ref = tables[0]
    ref_by_name = {name: (shape, dtype) for name, shape, dtype in ref}
    for r, table in enumerate(tables[1:], start=1):
        by_name = {name: (shape, dtype) for name, shape, dtype in table}
        for name, shape, dtype in table:
            if name not in ref_by_name:
                return f"parameter {name!r} exists on rank {r} but not on rank 0"
            rshape, rdtype = ref_by_name[name]
            if shape != rshape:
                return (f"parameter {name!r} has shape {shape} on rank {r} but {rshape} "
                        "on rank 0")
            if dtype != rdtype:
                return f"parameter {name!r} is {dtype} on rank {r} but {rdtype} on rank 0"
        for name, _, _ in ref:
            if name not in by_name:
                return f"parameter {name!r} exists on rank 0 but not on rank {r}"
        if [n for n, _, _ in table] != [n for n, _, _ in ref]:
            return f"parameters are in a different order on rank {r} than on rank 0"
    return None
