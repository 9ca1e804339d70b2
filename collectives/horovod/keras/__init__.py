"""``horovod.tensorflow.keras`` on dtrun's runtime, for Keras 3 with the TensorFlow backend:
``import dtrun.collectives.horovod.keras as hvd``.

``DistributedOptimizer`` wraps a Keras optimizer so that ``apply`` (what ``model.fit`` and
``apply_gradients`` call) averages the gradients over ranks first, in one grouped
allreduce; ``hvd.callbacks`` holds Horovod's callbacks. Everything else is
``collectives.horovod.tensorflow``'s. Imports TensorFlow and Keras, never torch.
"""

from __future__ import annotations

import keras

from .. import _core
from ..tensorflow import (Average, Compression, HorovodInternalError,  # noqa: F401
                          HorovodMismatchError, HorovodUnsupportedError, Max, Min, Product,
                          Sum, allgather, allgather_object, allreduce, alltoall, barrier,
                          broadcast, broadcast_object, broadcast_variables, ccl_built,
                          cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                          gloo_enabled, global_process_set, grouped_allreduce, init,
                          is_homogeneous, is_initialized, join, local_rank, local_size,
                          mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                          reducescatter, rocm_built, shutdown, size)
from ..tensorflow import DistributedOptimizer  # noqa: F401 (Horovod's keras name)
from . import callbacks  # noqa: F401


def broadcast_global_variables(root_rank: int) -> None:
    """Broadcast root's variables of every Keras model and optimizer alive in this process
    (Keras 3 keeps no global collection: they are found by the garbage collector and
    matched by variable path)."""
    import gc
    # Models and optimizers a rank no longer holds may sit in reference cycles until the
    # collector runs, which happens at a different moment on each rank: collect first, so
    # every rank finds the objects it still holds, and only those.
    gc.collect()
    seen, found = set(), []
    for obj in gc.get_objects():
        if isinstance(obj, (keras.Model, keras.optimizers.Optimizer)):
            for v in obj.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    found.append(v)
    found.sort(key=lambda v: (v.path, tuple(v.shape)))
    broadcast_variables(found, root_rank)


def __getattr__(name: str):
    if name == "SyncBatchNormalization":
        from ..tensorflow.sync_batch_norm import SyncBatchNormalization
        return SyncBatchNormalization
    if name in _core.UNSUPPORTED:
        raise _core.unsupported(name)
    raise AttributeError(f"module 'dtrun.collectives.horovod.keras' has no attribute {name!r}")
