"""``horovod.torch`` on dtrun's runtime: ``import dtrun.collectives.horovod.torch as hvd``.

Every collective is submitted to the engine of its process set (``collectives/horovod/
_core.py``), which matches it by name across the set's ranks in the background and runs
it on ``collectives.Comm``; results, gradients and errors are Horovod 0.28.1's.
``DistributedOptimizer`` over every rank is ``collectives.dp``'s, with Horovod's
arguments. Imports torch, never TensorFlow.

* ``_base.py``: tensors as NumPy arrays, requests, handles, Horovod's scaling arithmetic;
* ``ops.py``: allreduce, grouped_allreduce, reducescatter, grouped_reducescatter
  (asynchronous and in place), sparse_allreduce_async;
* ``gather.py``: allgather, grouped_allgather, broadcast, alltoall (asynchronous, in place);
* ``grads.py``: the blocking collectives, each with Horovod's gradient;
* ``functions.py``: broadcast_parameters, broadcast_optimizer_state, join;
* ``optimizer.py``: DistributedOptimizer.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import dp as _dp
from ..._mpi import MPI as _MPI
from .. import _core
from .._core import *  # noqa: F401,F403 (the framework-neutral API: _core.__all__)
from .._core import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,  # noqa: F401
                     add_process_set, allgather_object, broadcast_object, global_process_set,
                     remove_process_set)
from ._base import poll, synchronize  # noqa: F401
from .compression import Compression  # noqa: F401
from .functions import broadcast_optimizer_state, broadcast_parameters, join  # noqa: F401
from .gather import (alltoall_async, allgather_async, broadcast_, broadcast_async,  # noqa: F401
                     broadcast_async_, grouped_allgather_async)
from .grads import (allgather, allreduce, alltoall, broadcast, grouped_allgather,  # noqa: F401
                    grouped_allreduce, grouped_reducescatter, reducescatter)
from .ops import (allreduce_, allreduce_async, allreduce_async_, grouped_allreduce_,  # noqa: F401
                  grouped_allreduce_async, grouped_allreduce_async_,
                  grouped_reducescatter_async, reducescatter_async, sparse_allreduce_async)
from .optimizer import DistributedOptimizer  # noqa: F401
from .sync_batch_norm import SyncBatchNorm  # noqa: F401

__all__ = _core.__all__ + [
    "init", "nccl_built", "cuda_built",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "poll", "synchronize",
    "broadcast_object", "allgather_object", "broadcast_parameters",
    "broadcast_optimizer_state", "DistributedOptimizer", "Compression", "SyncBatchNorm",
]


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start (or join) the job (collective on the first call; later calls return at once,
    adding ``process_sets``). ``comm``: a ``collectives.Comm`` to run on (Horovod's
    ``comm=[ranks]`` subsets are not provided); ``process_sets``: ``hvd.ProcessSet``\\ s or
    lists of ranks, registered in order on every rank."""
    _core.check_init_args(comm, process_sets)
    if _core.is_initialized():
        _core.init(process_sets=process_sets)
        return
    ctx = _dp.init(comm)
    # The hvd collectives run on their own duplicate of the world, so that an
    # hvd.allreduce issued while DistributedOptimizer's background thread reduces a
    # bucket can never be matched with that bucket on another rank. Without
    # MPI_THREAD_MULTIPLE they share collectives.dp's lock.
    multiple = _MPI.Query_thread() >= _MPI.THREAD_MULTIPLE
    _core.init(ctx.comm.split(0), lock=None if multiple else _dp.LOCK,
               process_sets=process_sets)


def nccl_built() -> bool: return _core.flag("nccl_built") and torch.cuda.is_available()  # noqa: E704
def cuda_built() -> bool: return _core.flag("cuda_built") and torch.cuda.is_available()  # noqa: E704


def __getattr__(name: str):
    if name in _core.UNSUPPORTED:
        raise _core.unsupported(name)
    raise AttributeError(f"module 'dtrun.collectives.horovod.torch' has no attribute {name!r}")


from . import elastic  # noqa: E402,F401 (hvd.elastic.run, hvd.elastic.TorchState, as Horovod's)
