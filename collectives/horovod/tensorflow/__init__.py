"""``horovod.tensorflow`` on dtrun's runtime: ``import dtrun.collectives.horovod.tensorflow as hvd``.

TensorFlow 2, eager and inside ``tf.function``: the collectives take ``tf.Tensor`` and
``tf.Variable``, run on ``collectives.Comm`` (matched by name across ranks, see
``collectives/horovod/_core.py``) and give ``tf.Tensor`` back; inside a ``tf.function``
they run through ``tf.py_function`` (so not under XLA: ``jit_compile=True`` cannot
compile them). ``allreduce``, ``allgather`` and ``broadcast`` have gradients.
Imports TensorFlow, never torch.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import tensorflow as tf

from .. import _core
from .._core import *  # noqa: F401,F403 (the framework-neutral API: _core.__all__)
from .._core import Average, Sum, global_process_set, local_rank, local_size, rank, size
from ..compression import FP16Compressor, NoneCompressor

__all__ = _core.__all__ + [
    "init", "nccl_built", "cuda_built", "size_op", "rank_op", "local_size_op", "local_rank_op",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "join", "broadcast_variables", "broadcast_object",
    "allgather_object", "DistributedGradientTape", "DistributedOptimizer", "Compression",
    "SyncBatchNormalization",
]


# ----------------------------------------------------------------------------- start-up
def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start (or join) the job (collective on first call)."""
    _core.check_init_args(comm, process_sets)
    _core.init(comm)


def _job(op: str) -> _core.Job:
    return _core.job(op)


def size_op(process_set_id: int = 0, name=None): return tf.constant(size())  # noqa: E704
def rank_op(name=None): return tf.constant(rank())  # noqa: E704
def local_size_op(name=None): return tf.constant(local_size())  # noqa: E704
def local_rank_op(name=None): return tf.constant(local_rank())  # noqa: E704


def nccl_built() -> bool: return False  # noqa: E704 (TF tensors travel through host memory)
def cuda_built() -> bool: return False  # noqa: E704


class _FP16Compressor(FP16Compressor):
    float16 = tf.float16
    is_float = staticmethod(lambda dtype: dtype.is_floating)
    cast = staticmethod(tf.cast)


class Compression:
    """``Compression.none`` and ``Compression.fp16``, as in Horovod."""

    none = NoneCompressor
    fp16 = _FP16Compressor


# ----------------------------------------------------------------------------- the bridge
def _dense(t) -> tf.Tensor:
    if isinstance(t, tf.IndexedSlices):
        return tf.convert_to_tensor(t)  # reduced dense: the same values as Horovod's
    return tf.convert_to_tensor(t)


def _np(t) -> np.ndarray:
    a = t.numpy()
    return np.ascontiguousarray(a) if isinstance(a, np.ndarray) else np.asarray(a)


def _collective(kind: str, fn: Callable[..., list[np.ndarray]], inputs: list, out_dtypes: list,
                out_shapes: list | None = None, name: str | None = None, op: str = "",
                root: int = -1) -> list[tf.Tensor]:
    """Run ``fn`` (NumPy arrays in, NumPy arrays out) as the collective ``kind`` on
    every rank, submitted under ``name``: directly when eager, through
    ``tf.py_function`` inside a ``tf.function`` (the name is drawn when it runs)."""
    from ...dtypes import dtype_name

    def body(*tensors):
        xs = [_np(t) for t in tensors]
        j = _job(kind)
        req = _core.Request(kind, j.engine.name(kind, name), tuple(x.shape for x in xs),
                            tuple(dtype_name(x.dtype) for x in xs), op, root,
                            lambda: fn(j.comm, *xs))
        return j.engine.synchronize(j.engine.submit(req))

    if tf.executing_eagerly():
        outs = body(*inputs)
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, out_dtypes)]
    outs = tf.py_function(lambda *ts: [tf.convert_to_tensor(o, dtype=d)
                                       for o, d in zip(body(*ts), out_dtypes)],
                          inputs, out_dtypes)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for o, s in zip(outs, out_shapes or []):
        if s is not None:
            o.set_shape(s)
    return outs


# -- allreduce
def _allreduce(x: tf.Tensor, op: str, pre: float, post: float, name: str | None) -> tf.Tensor:
    @tf.custom_gradient
    def f(t):
        (y,) = _collective("allreduce", lambda comm, a: [_core.np_allreduce(comm, a, op, pre, post)],
                           [t], [t.dtype], [t.shape], name, op)

        def grad(dy):
            return _allreduce(tf.convert_to_tensor(dy), op if op in (Average, Sum) else Sum,
                              pre, post, None)
        return y, grad
    return f(x)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """Reduce ``tensor`` over all ranks (default: average). ``tf.IndexedSlices`` are
    reduced dense."""
    _core.check_process_set(process_set, "allreduce")
    op = _core.op_from_average(op, average, "allreduce")
    compressed, ctx = compression.compress(_dense(tensor))
    return compression.decompress(_allreduce(compressed, op, prescale_factor, postscale_factor,
                                             name), ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, name=None):
    """Allreduce a list of tensors as one operation (one negotiation, fused buffers)."""
    _core.check_process_set(process_set, "grouped_allreduce")
    op = _core.op_from_average(op, average, "grouped_allreduce")
    pairs = [compression.compress(_dense(t)) for t in tensors]
    xs = [p[0] for p in pairs]
    if not xs:
        return []

    def fn(comm, *arrays):
        plain = prescale_factor == 1.0 and postscale_factor == 1.0 and not any(
            a.dtype.kind in "iub" or _core._is_bf16(a) for a in arrays)
        if plain:
            ys = [a.copy() for a in arrays]
            comm.grouped_allreduce(ys, op=op)
            return ys
        return [_core.np_allreduce(comm, a, op, prescale_factor, postscale_factor)
                for a in arrays]
    outs = _collective("grouped_allreduce", fn, xs, [x.dtype for x in xs],
                       [x.shape for x in xs], name, op)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


# -- allgather, broadcast, alltoall, reducescatter
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension (its length may
    differ per rank)."""
    _core.check_process_set(process_set, "allgather")
    x = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def f(t):
        (y,) = _collective("allgather", lambda comm, a: [_core.np_allgather(comm, a)], [t],
                           [t.dtype], [tf.TensorShape([None]).concatenate(t.shape[1:])
                                       if t.shape.rank else None], name)

        def grad(dy):
            rows = tf.shape(t)[0] if t.shape.rank else 1
            counts = _collective("allgather", lambda comm, a: [_core.np_allgather(comm, a)],
                                 [tf.reshape(tf.cast(rows, tf.int64), [1])], [tf.int64])[0]
            summed = _allreduce(tf.convert_to_tensor(dy), Sum, 1.0, 1.0, None)
            start = tf.reduce_sum(counts[:rank()])
            return tf.reshape(summed[start:start + rows], tf.shape(t))
        return y, grad
    return f(x)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Root's ``tensor`` on every rank."""
    _core.check_process_set(process_set, "broadcast")
    j = _job("broadcast")
    if not 0 <= int(root_rank) < j.size:
        raise ValueError(f"broadcast: root_rank {root_rank} is not a rank of this job "
                         f"(0..{j.size - 1})")
    x = tf.convert_to_tensor(tensor)
    root = int(root_rank)

    def fn(comm, a):
        y = a.copy()
        comm.broadcast(_core.bits(y), root=root, inplace=True)
        return [y]

    @tf.custom_gradient
    def f(t):
        (y,) = _collective("broadcast", fn, [t], [t.dtype], [t.shape], name, root=root)

        def grad(dy):
            summed = _allreduce(tf.convert_to_tensor(dy), Sum, 1.0, 1.0, None)
            return summed if rank() == root else tf.zeros_like(summed)
        return y, grad
    return f(x)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``variables`` (one or a list) with root's, in place; returns them."""
    many = isinstance(variables, (list, tuple))
    broadcast_variables(list(variables) if many else [variables], root_rank, process_set)
    return variables


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Rank i sends rows ``splits[j]`` of ``tensor`` to rank j (default: equal parts).
    Returns the received rows, and with ``splits`` also the rows received from each rank."""
    _core.check_process_set(process_set, "alltoall")
    x = tf.convert_to_tensor(tensor)
    inputs = [x] if splits is None else [x, tf.cast(tf.convert_to_tensor(splits), tf.int64)]

    def fn(comm, a, sp=None):
        out, received = _core.np_alltoall(comm, a, sp)
        return [out, received.astype(np.int32)]
    out, received = _collective("alltoall", fn, inputs, [x.dtype, tf.int32],
                                [tf.TensorShape([None]).concatenate(x.shape[1:])
                                 if x.shape.rank else None, None], name)
    return out if splits is None else (out, received)


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average,
                  name=None, process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over ranks (default: average), then rank r keeps its share of the first
    dimension (the first ``n % size`` ranks get one row more)."""
    _core.check_process_set(process_set, "reducescatter")
    op = _core.check_op(op, "reducescatter")
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    (y,) = _collective("reducescatter", lambda comm, a: [
        _core.np_reducescatter(comm, a, op, prescale_factor, postscale_factor)],
        [compressed], [compressed.dtype], None, name, op)
    return compression.decompress(y, ctx)


def join() -> int:
    """This rank has no more data: take part in the other ranks' allreduces and
    broadcasts with zeros until every rank has joined; returns the rank that joined last."""
    return _job("join").engine.join()


# ----------------------------------------------------------------------------- variables, objects
def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign root's values to ``variables`` on every rank: one broadcast per dtype."""
    _core.check_process_set(process_set, "broadcast_variables")
    variables = list(variables)
    by_dtype: dict[Any, list] = {}
    for v in variables:
        by_dtype.setdefault(tf.as_dtype(v.dtype), []).append(v)  # Keras 3: a string
    for dtype in sorted(by_dtype, key=lambda d: d.name):
        vs = by_dtype[dtype]
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in vs], axis=0)
        flat = broadcast(flat, root_rank, name=f"broadcast_variables.{dtype.name}.{len(vs)}.{_bv_count()}")
        start = 0
        for v in vs:
            n = int(np.prod(v.shape))
            v.assign(tf.reshape(flat[start:start + n], v.shape))
            start += n


_BV = [0]


def _bv_count() -> int:
    _BV[0] += 1
    return _BV[0]


def broadcast_object(obj: Any, root_rank: int = 0, session=None, name=None,
                     process_set=global_process_set) -> Any:
    """Root's picklable ``obj`` on every rank."""
    _core.check_process_set(process_set, "broadcast_object")
    return _core.broadcast_object(obj, root_rank)


def allgather_object(obj: Any, session=None, name=None, process_set=global_process_set) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    _core.check_process_set(process_set, "allgather_object")
    return _core.allgather_object(obj)


# ----------------------------------------------------------------------------- training
def _check_gradient_args(op, gradient_predivide_factor, where):
    op = _core.check_op(op, where, (Average, Sum))
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    return op


def _scales(op, f):
    """(op, prescale, postscale) for Horovod's gradient_predivide_factor f."""
    if f == 1.0:
        return op, 1.0, 1.0
    return Average, 1.0 / f, f  # average(g / f) * f == sum(g / f) * f / size


def allreduce_gradients(grads, op=Average, compression=Compression.none,
                        gradient_predivide_factor=1.0):
    """Average (or sum) a list of gradients over ranks in one grouped allreduce; None
    entries stay None, ``tf.IndexedSlices`` come back dense."""
    op, pre, post = _scales(op, float(gradient_predivide_factor))
    idx = [i for i, g in enumerate(grads) if g is not None]
    if _job("allreduce_gradients").size == 1 or not idx:
        return [None if g is None else _dense(g) for g in grads]
    reduced = grouped_allreduce([grads[i] for i in idx], op=op, compression=compression,
                                prescale_factor=pre, postscale_factor=post)
    out = list(grads)
    for i, r in zip(idx, reduced):
        out[i] = r
    return out


class _DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged over ranks."""

    def __init__(self, tape, compression, op, gradient_predivide_factor):
        self._tape = tape
        self._hvd = (compression, op, gradient_predivide_factor)

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    **{k: v for k, v in kwargs.items()
                                       if k in ("unconnected_gradients",)})
        compression, op, f = self._hvd
        flat = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, allreduce_gradients(flat, op, compression, f))


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",  # noqa: N802
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """Wrap ``gradtape`` so that ``gradient()`` averages (``op=Average``) or sums the
    gradients over ranks, in one grouped allreduce."""
    _core.check_process_set(process_set, "DistributedGradientTape")
    op = _check_gradient_args(op, gradient_predivide_factor, "DistributedGradientTape")
    return _DistributedGradientTape(gradtape, compression, op, float(gradient_predivide_factor))


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """A copy of the Keras ``optimizer`` (``tf.keras``/Keras 3; same class and config)
    whose ``apply`` averages (``op=Average``) or sums the gradients over ranks before
    applying them (also ``collectives.horovod.keras.DistributedOptimizer``).

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


def __dir__():
    return sorted(set(globals()) | {"SyncBatchNormalization"})


def _sync_batch_norm():
    from .sync_batch_norm import SyncBatchNormalization
    return SyncBatchNormalization


_LAZY = {"SyncBatchNormalization": _sync_batch_norm}


def __getattr__(name: str):
    if name in _LAZY:
        value = _LAZY[name]()
        globals()[name] = value
        return value
    if name in _core.UNSUPPORTED:
        raise _core.unsupported(name)
    raise AttributeError(f"module 'dtrun.collectives.horovod.tensorflow' has no attribute {name!r}")
