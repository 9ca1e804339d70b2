"""``horovod.tensorflow`` on dtrun's runtime: ``import dtrun.collectives.horovod.tensorflow as hvd``.

TensorFlow 2, eager, inside ``tf.function`` and in ``tf.compat.v1`` graphs run by a
session: the collectives take ``tf.Tensor``, ``tf.Variable`` and ``tf.IndexedSlices``, run on
the runtime's collectives (matched across ranks by name, one engine per process set: see
``_bridge.py``) and give tensors back, with Horovod's gradients (``mpi_ops.py``) and errors
(``_errors.py``). In a graph they run through ``tf.py_function``, so not under XLA
(``jit_compile=True`` cannot compile them). Imports TensorFlow, never torch.
"""

from __future__ import annotations

import tensorflow as tf

from .. import _core
from .._core import *  # noqa: F401,F403 (the framework-neutral API: _core.__all__)
from .._core import Adasum, Average, Sum, global_process_set
from ..compression import FP16Compressor, NoneCompressor
from . import _bridge, util  # noqa: F401 (util: horovod.tensorflow.util)
from ._errors import HorovodInvalidArgumentError, HorovodPreconditionError  # noqa: F401
from .functions import (allgather_object, broadcast_object,  # noqa: F401
                        broadcast_object_fn, broadcast_variables)
from .mpi_ops import (_allreduce, _grouped_allreduce, _grouped_reducescatter,  # noqa: F401
                      _reducescatter, allgather, alltoall, broadcast, broadcast_,
                      grouped_allgather, join, local_rank_op, local_size_op,
                      process_set_included_op, rank_op, size_op)
from .util import _cache, _executing_eagerly, _make_subgraph, refs_to_vars, vars_to_refs  # noqa: F401


# Called inside tf.function, these run as plain Python (AutoGraph leaves them alone).
_plain = tf.autograph.experimental.do_not_convert

__all__ = _core.__all__ + [
    "init", "nccl_built", "cuda_built", "size_op", "rank_op", "local_size_op", "local_rank_op",
    "process_set_included_op", "allreduce", "grouped_allreduce", "allgather",
    "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "join", "broadcast_variables", "broadcast_global_variables",
    "broadcast_object", "broadcast_object_fn", "allgather_object", "DistributedGradientTape",
    "PartialDistributedGradientTape", "DistributedOptimizer", "BroadcastGlobalVariablesHook",
    "Compression", "SyncBatchNormalization",
]


# ----------------------------------------------------------------------------- start-up
def init(comm=None, process_sets=None) -> None:
    """Start (or join) the job (collective on first call; later calls return at once).
    ``process_sets``: ProcessSets (or lists of ranks) to register, in order."""
    _core.check_init_args(comm, process_sets)
    _core.init(comm, process_sets=process_sets)


def nccl_built() -> bool: return False  # noqa: E704 (TF tensors travel through host memory)
def cuda_built() -> bool: return False  # noqa: E704


def handle_average_backwards_compatibility(op, average):
    """Horovod's fold of the deprecated ``average=`` into ``op`` (None: Average)."""
    return _core.op_from_average(op, average, "allreduce")


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (what Adasum needs)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


class _FP16Compressor(FP16Compressor):
    float16 = tf.float16
    is_float = staticmethod(lambda dtype: dtype.is_floating)
    cast = staticmethod(tf.cast)


class Compression:
    """``Compression.none`` and ``Compression.fp16``, as in Horovod."""

    none = NoneCompressor
    fp16 = _FP16Compressor


# ----------------------------------------------------------------------------- sparse
_SPARSE_OPS = "Only Sum and Average ops are supported with tf.IndexedSlices"


def _op(op, average, where: str):
    """Horovod's ``op``/``average=`` pair as one op (Adasum included, for dense tensors)."""
    if average is None and isinstance(op, str) and op.lower() == Adasum:
        return Adasum
    return _core.op_from_average(op, average, where)


def _check_sparse(op, prescale_factor, postscale_factor) -> None:
    if op == Adasum:
        raise NotImplementedError(
            "The Adasum reduction does not currently support sparse tensors. As a workaround "
            "please pass sparse_as_dense=True to DistributedOptimizer")
    if op not in (Sum, Average):
        raise NotImplementedError(_SPARSE_OPS)
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _sparse_values(values, op, process_set) -> list:
    """Gathered values, divided by the set's size for an average (Horovod's)."""
    n = _bridge.scope(process_set, "allreduce").size
    return [v / tf.cast(n, v.dtype) if op == Average else v for v in values]


# ----------------------------------------------------------------------------- reductions
@_plain
def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """Reduce ``tensor`` over the ranks of the set (default: average). A
    ``tf.IndexedSlices`` is gathered (values and indices) instead, as Horovod does: the
    result is a ``tf.IndexedSlices`` holding every rank's slices (values divided by the
    size for an average)."""
    op = _op(op, average, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        values = allgather(tensor.values, process_set=process_set,
                           ignore_name_scope=ignore_name_scope)
        indices = allgather(tensor.indices, process_set=process_set,
                            ignore_name_scope=ignore_name_scope)
        (values,) = _sparse_values([values], op, process_set)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    reduced = _allreduce(compressed, name=name, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, ignore_name_scope=ignore_name_scope,
                         process_set=process_set)
    return compression.decompress(reduced, ctx)


@_plain
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Allreduce a list of tensors as one collective (one negotiation, fused buffers);
    ``tf.IndexedSlices`` among them are gathered as ``allreduce`` does, in one grouped
    allgather of values and one of indices."""
    if not tensors:
        return tensors
    op = _op(op, average, "grouped_allreduce")
    out = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
        kw = dict(process_set=process_set, ignore_name_scope=ignore_name_scope)
        values = grouped_allgather([tensors[i].values for i in sparse], **kw)
        indices = grouped_allgather([tensors[i].indices for i in sparse], **kw)
        for i, v, ix in zip(sparse, _sparse_values(values, op, process_set), indices):
            out[i] = tf.IndexedSlices(v, ix, dense_shape=tensors[i].dense_shape)
    if dense:
        pairs = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
        reduced = _grouped_allreduce([p[0] for p in pairs], name=name, op=op,
                                     prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor,
                                     ignore_name_scope=ignore_name_scope, process_set=process_set)
        for i, r, (_, ctx) in zip(dense, reduced, pairs):
            out[i] = compression.decompress(r, ctx)
    return out


@_plain
def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average,
                  name=None, process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over the set's ranks (default: average), then rank r keeps its share of the
    first dimension (the first ``n % size`` ranks get one row more)."""
    op = _core.check_op(op, "reducescatter")
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    reduced = _reducescatter(compressed, name=name, op=op, ignore_name_scope=ignore_name_scope,
                             process_set=process_set, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor)
    return compression.decompress(reduced, ctx)


@_plain
def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """``reducescatter`` of every tensor of ``tensors`` as one collective."""
    if not tensors:
        return tensors
    op = _core.check_op(op, "grouped_reducescatter")
    pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    reduced = _grouped_reducescatter([p[0] for p in pairs], op=op, process_set=process_set,
                                     prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


# ----------------------------------------------------------------------------- training
from .optimizer import DistributedOptimizer  # noqa: E402,F401
from .tf1 import BroadcastGlobalVariablesHook, broadcast_global_variables  # noqa: E402,F401
from .training import (DistributedGradientTape, PartialDistributedGradientTape,  # noqa: E402,F401
                       allreduce_gradients)


def __dir__():
    return sorted(set(globals()) | {"SyncBatchNormalization"})


def __getattr__(name: str):
    if name == "SyncBatchNormalization":
        from .sync_batch_norm import SyncBatchNormalization  # lazy: imports keras, few scripts use it
        globals()[name] = SyncBatchNormalization
        return SyncBatchNormalization
    if name in _core.UNSUPPORTED:
        raise _core.unsupported(name)
    raise AttributeError(f"module 'dtrun.collectives.horovod.tensorflow' has no attribute {name!r}")


from . import elastic  # noqa: E402,F401 (hvd.elastic.run, hvd.elastic.TensorFlowKerasState, as Horovod's)
