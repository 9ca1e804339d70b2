"""``horovod.tensorflow.keras`` on dtrun's runtime, for Keras 3 with the TensorFlow backend:
``import collectives.horovod.keras as hvd``.

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
from ..tensorflow import _check_gradient_args, allreduce_gradients
from . import callbacks  # noqa: F401


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """A copy of ``optimizer`` (same class and config) whose ``apply`` averages
    (``op=Average``) or sums the gradients over ranks before applying them.

    Accumulating gradients: use the Keras optimizer's own ``gradient_accumulation_steps``
    (``backward_passes_per_step`` > 1 is refused).
    """
    _core.check_process_set(process_set, "DistributedOptimizer")
    op = _check_gradient_args(op, gradient_predivide_factor, "DistributedOptimizer")
    if int(backward_passes_per_step) != 1:
        raise ValueError("backward_passes_per_step > 1: give the Keras optimizer "
                         "gradient_accumulation_steps=N instead")
    f = float(gradient_predivide_factor)
    base = optimizer.__class__

    def apply(self, grads, trainable_variables=None):
        grads = allreduce_gradients(list(grads), op, compression, f)
        return base.apply(self, grads, trainable_variables)

    cls = type(base.__name__, (base,), {"apply": apply, "_hvd_distributed": True})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)


def broadcast_global_variables(root_rank: int) -> None:
    """Broadcast root's variables of every Keras model and optimizer alive in this process
    (Keras 3 keeps no global collection: they are found by the garbage collector and
    matched by variable path)."""
    import gc
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
    raise AttributeError(f"module 'collectives.horovod.keras' has no attribute {name!r}")
