"""``horovod.tensorflow.keras`` (and ``horovod.keras``) on dtrun's runtime:
``import dtrun.collectives.horovod.keras as hvd``.

For the Keras ``tf.keras`` is: Keras 3 by default, Keras 2 (``tf_keras``) under
``TF_USE_LEGACY_KERAS=1``. ``DistributedOptimizer`` wraps a Keras optimizer so that the
gradients it applies are averaged over ranks first (``optimizer.py`` says where);
``hvd.callbacks`` holds Horovod's callbacks, ``hvd.elastic`` its elastic API (``elastic.py``).
Everything else is ``collectives.horovod.tensorflow``'s. Imports TensorFlow, never torch.
"""

from __future__ import annotations

import tensorflow as tf

from .. import _core
from .. import tensorflow as _tf_hvd
from ..tensorflow import (Average, Compression, HorovodInternalError,  # noqa: F401
                          HorovodMismatchError, HorovodUnsupportedError, Max, Min, Product,
                          ProcessSet, Sum, add_process_set, allgather_object, alltoall,
                          barrier, broadcast_object, broadcast_variables, ccl_built,
                          cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                          gloo_enabled, global_process_set, grouped_allreduce, init,
                          is_homogeneous, is_initialized, join, local_rank, local_size,
                          mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                          remove_process_set, rocm_built, shutdown, size, start_timeline,
                          stop_timeline)
from ..tensorflow import tf1 as _tf1
from ..tensorflow.training import local_layer_weights, reduction
from . import callbacks, elastic  # noqa: F401 (hvd.callbacks, hvd.elastic, as Horovod's)
from . import saving as _saving
from .optimizer import wrap


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """A copy of the Keras ``optimizer`` (same class, same config) whose gradients are
    averaged (``op=Average``) or summed over the process set's ranks before they are
    applied. ``backward_passes_per_step=N`` sums N passes' gradients locally and reduces
    and applies every N-th (divided by N with ``average_aggregated_gradients``)."""
    if op != Average and op != Sum:
        raise ValueError("op currently only supports Average and Sum")
    how = reduction(op, compression, sparse_as_dense, gradient_predivide_factor, num_groups,
                    groups, process_set, scale_local_gradients)
    return wrap(optimizer, name, how, int(backward_passes_per_step),
                average_aggregated_gradients)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="",  # noqa: N802
                                device_sparse="", compression=Compression.none,
                                sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, groups=None, process_set=global_process_set,
                                local_layers=None, scale_local_gradients=True):
    """``DistributedOptimizer`` that keeps the gradients of ``local_layers``' trainable
    weights on each rank (divided by the set's size when ``scale_local_gradients``)."""
    local = local_layer_weights(local_layers)
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                               sparse_as_dense, gradient_predivide_factor, op, groups=groups,
                               process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    for var in local:
        opt.register_local_var(var)
    return opt


def broadcast_global_variables(root_rank: int):
    """Broadcast root's variables of every Keras model and optimizer alive in this
    process (Keras keeps no global collection eagerly: they are found by the garbage
    collector and matched by name). In a TensorFlow 1 graph: the graph's global
    variables, run in Keras's session."""
    if not tf.executing_eagerly():
        return tf.compat.v1.keras.backend.get_session().run(_tf1.broadcast_global_variables(root_rank))
    broadcast_variables(_live_keras_variables(), root_rank)


def _live_keras_variables() -> list:
    import gc
    # Models and optimizers a rank no longer holds may sit in reference cycles until the
    # collector runs, which happens at a different moment on each rank: collect first, so
    # every rank finds the objects it still holds, and only those.
    gc.collect()
    kinds = _keras_model_and_optimizer_classes()
    seen, found = set(), []
    for obj in gc.get_objects():
        if isinstance(obj, kinds):
            vs = obj.variables
            for v in (vs() if callable(vs) else vs):
                if id(v) not in seen:
                    seen.add(id(v))
                    found.append(v)
    found.sort(key=lambda v: (getattr(v, "path", None) or v.name, tuple(v.shape)))
    return found


def _keras_model_and_optimizer_classes() -> tuple:
    import sys
    kinds = []
    if "keras" in sys.modules:
        import keras
        kinds += [keras.Model, keras.optimizers.Optimizer]
    if "tf_keras" in sys.modules:
        import tf_keras
        kinds += [tf_keras.Model, tf_keras.optimizers.Optimizer,
                  tf_keras.optimizers.legacy.Optimizer]
    return tuple(kinds)


def _constant(value, name):
    return tf.constant(value, name=name)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """Reduce a tensor-compatible ``value`` over ranks (default: average)."""
    return _tf_hvd.allreduce(_constant(value, name), average=average,
                             prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, op=op, compression=compression)


def allgather(value, name=None):
    """Concatenate every rank's ``value`` along the first dimension."""
    return _tf_hvd.allgather(_constant(value, name))


def broadcast(value, root_rank, name=None):
    """Root's ``value`` on every rank."""
    return _tf_hvd.broadcast(_constant(value, name), root_rank)


def reducescatter(value, name=None, op=Average):
    """Reduce ``value`` over ranks, each keeping its share of the first dimension."""
    return _tf_hvd.reducescatter(_constant(value, name), op=op)


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """``tf.keras.models.load_model``, with the saved optimizer wrapped in a
    ``DistributedOptimizer`` (every optimizer class of ``tf.keras.optimizers``, and
    ``custom_optimizers``)."""
    return _saving.load_model(DistributedOptimizer, filepath, custom_optimizers, custom_objects,
                              compression, legacy_opts)


def __getattr__(name: str):
    if name == "SyncBatchNormalization":
        from ..tensorflow.sync_batch_norm import SyncBatchNormalization  # lazy: imports keras, few scripts use it
        return SyncBatchNormalization
    if name in _core.UNSUPPORTED:
        raise _core.unsupported(name)
    raise AttributeError(f"module 'dtrun.collectives.horovod.keras' has no attribute {name!r}")
