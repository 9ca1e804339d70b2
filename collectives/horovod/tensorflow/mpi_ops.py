"""Horovod's TensorFlow collectives (``horovod.tensorflow.mpi_ops``) on dtrun's runtime, with
Horovod's gradients, eager and in graphs (``collectives/horovod/tensorflow/_bridge.py`` says
how they run and are named). Sum is the default reduction here, as in Horovod's module; the
public ``allreduce``/``reducescatter`` in ``__init__`` default to Average.

Scaling follows Horovod's CPU ops: integers are scaled in float64 and truncated, float16
in float32 and rounded once (a float16 average is the sum scaled once by
``postscale / size``).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import _core
from .._adasum import adasum_allreduce
from .._core import Adasum, Average, Sum, global_process_set, np_allgather, split_rows
from . import _bridge, _errors


# Called inside tf.function, these run as plain Python (AutoGraph leaves them alone).
_plain = tf.autograph.experimental.do_not_convert


# ----------------------------------------------------------------------------- NumPy halves
def _scale16(a: np.ndarray, factor: float) -> np.ndarray:
    return (a.astype(np.float32) * np.float32(factor)).astype(np.float16)


def np_allreduce(comm, a: np.ndarray, op: str, pre: float, post: float) -> np.ndarray:
    """Horovod's allreduce of ``a`` over ``comm`` (see the module docstring)."""
    if op == Adasum:
        y = a if pre == 1.0 else a * a.dtype.type(pre)
        y = adasum_allreduce(comm, np.ascontiguousarray(y), check=False)
        return y if post == 1.0 else y * y.dtype.type(post)
    if a.dtype == np.float16 and (pre != 1.0 or post != 1.0 or op == Average):
        y = _scale16(a, pre) if pre != 1.0 else a.copy()
        y = _core.np_allreduce(comm, y, Sum if op == Average else op, inplace=True)
        f = post / comm.size if op == Average else post
        return _scale16(y, f) if f != 1.0 else y
    return _core.np_allreduce(comm, a, op, pre, post)


def np_reducescatter(comm, a: np.ndarray, op: str, pre: float, post: float) -> np.ndarray:
    """Horovod's reducescatter: reduce, then rank r keeps its rows (the first
    ``n % size`` ranks one more)."""
    if a.dtype == np.float16 and (pre != 1.0 or post != 1.0 or op == Average):
        rows = split_rows(a.shape[0], comm.size)
        start = sum(rows[:comm.rank])
        return np_allreduce(comm, a, op, pre, post)[start:start + rows[comm.rank]].copy()
    return _core.np_reducescatter(comm, a, op, pre, post)


def _no_scalars(kind: str):
    def check(sc, *arrays):
        if any(a.ndim == 0 for a in arrays):
            raise _errors.invalid_argument(kind, _core.rank(), "a scalar cannot be scattered; "
                                           "give tensors of at least one dimension")
    return check


def _check_alltoall(sc, a: np.ndarray, splits: np.ndarray) -> None:
    rows = a.shape[0] if a.ndim else 0
    if a.ndim == 0:
        problem = "a scalar cannot be split; give a tensor of at least one dimension"
    elif splits.size == 0:
        problem = None if rows % sc.size == 0 else (
            f"the first dimension {rows} does not split evenly over {sc.size} ranks; pass splits=")
    elif splits.size != sc.size or (splits < 0).any() or int(splits.sum()) != rows:
        problem = (f"splits {splits.tolist()} must be {sc.size} non-negative row counts summing "
                   f"to the first dimension {rows}")
    else:
        problem = None
    if problem:
        raise _errors.invalid_argument("alltoall", _core.rank(), problem)


def _gathered(t: tf.Tensor) -> tf.TensorShape | None:
    return tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else None


# ----------------------------------------------------------------------------- allreduce
@_plain
def _allreduce(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
               ignore_name_scope=False, process_set=global_process_set):
    """Reduce ``tensor`` over the ranks of ``process_set`` (default op: Sum)."""
    pre, post = float(prescale_factor), float(postscale_factor)

    @tf.custom_gradient
    def f(t):
        (y,) = _bridge.run("allreduce", lambda sc, a: [np_allreduce(sc.comm, a, op, pre, post)],
                           [t], [t.dtype], [t.shape], op=op, process_set=process_set,
                           name=_bridge.graph_name("HorovodAllreduce", [t], name),
                           ignore_name_scope=ignore_name_scope)

        def grad(dy):
            return _allreduce(tf.convert_to_tensor(dy), op=op, prescale_factor=pre,
                              postscale_factor=post, ignore_name_scope=ignore_name_scope,
                              process_set=process_set)
        return y, grad
    return f(tf.convert_to_tensor(tensor))


@_plain
def _grouped_allreduce(tensors, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                       ignore_name_scope=False, process_set=global_process_set):
    """Reduce every tensor of ``tensors`` as one collective (one negotiation)."""
    pre, post = float(prescale_factor), float(postscale_factor)
    xs = [tf.convert_to_tensor(t) for t in tensors]

    def fn(sc, *arrays):
        plain = pre == 1.0 and post == 1.0 and op != Adasum and not any(
            a.dtype.kind in "iub" or a.dtype == np.float16 or _core._is_bf16(a) for a in arrays)
        if plain:
            ys = [a.copy() for a in arrays]
            sc.comm.grouped_allreduce(ys, op=op)
            return ys
        return [np_allreduce(sc.comm, a, op, pre, post) for a in arrays]

    @tf.custom_gradient
    def f(*ts):
        ys = _bridge.run("grouped_allreduce", fn, list(ts), [t.dtype for t in ts],
                         [t.shape for t in ts], op=op, process_set=process_set,
                         name=_bridge.graph_name("HorovodGroupedAllreduce", list(ts), name),
                         ignore_name_scope=ignore_name_scope)

        def grad(*dys):
            return _grouped_allreduce(_upstream(dys, ys), op=op, prescale_factor=pre,
                                      postscale_factor=post, ignore_name_scope=ignore_name_scope,
                                      process_set=process_set)
        return ys, grad
    return list(f(*xs)) if xs else []


def _upstream(dys, ys) -> list[tf.Tensor]:
    """The upstream gradients as dense tensors (zeros where an output got none)."""
    return [tf.zeros_like(y) if d is None else tf.convert_to_tensor(d) for d, y in zip(dys, ys)]


# ----------------------------------------------------------------------------- allgather
@_plain
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension (its length may differ
    per rank; the other dimensions may not)."""
    @tf.custom_gradient
    def f(t):
        (y,) = _bridge.run("allgather", lambda sc, a: [np_allgather(sc.comm, a)], [t],
                           [t.dtype], [_gathered(t)], process_set=process_set,
                           name=_bridge.graph_name("HorovodAllgather", [t], name),
                           ignore_name_scope=ignore_name_scope)

        def grad(dy):
            return _allgather_grads([t], [dy], ignore_name_scope, process_set)[0]
        return y, grad
    return f(tf.convert_to_tensor(tensor))


@_plain
def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """``allgather`` of every tensor of ``tensors`` as one collective."""
    xs = [tf.convert_to_tensor(t) for t in tensors]

    @tf.custom_gradient
    def f(*ts):
        ys = _bridge.run("grouped_allgather", lambda sc, *arrays: [
            np_allgather(sc.comm, a) for a in arrays], list(ts), [t.dtype for t in ts],
            [_gathered(t) for t in ts], process_set=process_set,
            name=_bridge.graph_name("HorovodGroupedAllgather", list(ts), name),
            ignore_name_scope=ignore_name_scope)

        def grad(*dys):
            return _allgather_grads(list(ts), _upstream(dys, ys), ignore_name_scope, process_set)
        return ys, grad
    return list(f(*xs)) if xs else []


def _allgather_grads(inputs, grads, ignore_name_scope, process_set) -> list[tf.Tensor]:
    """Horovod's allgather gradient: the upstream gradient averaged over the ranks, and
    this rank's rows of it (found from every rank's first dimension)."""
    sc = _bridge.scope(process_set, "allgather")
    out = []
    for x, g in zip(inputs, grads):
        g = _allreduce(tf.convert_to_tensor(g), op=Average, ignore_name_scope=ignore_name_scope,
                       process_set=process_set)
        rows = tf.reshape(tf.shape(x)[0] if x.shape.rank != 0 else 1, [1])
        rows = tf.reshape(allgather(rows, ignore_name_scope=ignore_name_scope,
                                    process_set=process_set), [sc.size])
        mine = tf.split(g, num_or_size_splits=rows, axis=0)[sc.rank]
        out.append(tf.reshape(mine, tf.shape(x)) if x.shape.rank == 0 else mine)
    return out


# ----------------------------------------------------------------------------- broadcast
@_plain
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Rank ``root_rank``'s ``tensor`` (a rank of the job, as Horovod's) on every rank of
    the set."""
    try:
        _core.set_root(_bridge.scope(process_set, "broadcast"), root_rank, "broadcast")
    except ValueError as e:
        raise _errors.HorovodInvalidArgumentError(None, None, str(e)) from None
    root = int(root_rank)

    def fn(sc, a):
        y = a.copy()
        sc.comm.broadcast(_core.bits(y), root=sc.ranks.index(root), inplace=True)
        return [y]

    @tf.custom_gradient
    def f(t):
        (y,) = _bridge.run("broadcast", fn, [t], [t.dtype], [t.shape], root=root,
                           process_set=process_set, ignore_name_scope=ignore_name_scope,
                           name=_bridge.graph_name("HorovodBroadcast", [t], name))

        def grad(dy):
            g = _allreduce(tf.convert_to_tensor(dy), op=Average,
                           ignore_name_scope=ignore_name_scope, process_set=process_set)
            return g if _core.rank() == root else g * 0
        return y, grad
    return f(tf.convert_to_tensor(tensor))


@_plain
def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``variables`` (a list) with root's values, in place; returns their new
    values (read after the assignment, in a graph too)."""
    variables = list(variables)
    values = [broadcast(v, root_rank, name=None if name is None else f"{name}.{i}",
                        process_set=process_set) for i, v in enumerate(variables)]
    if tf.executing_eagerly():
        for v, x in zip(variables, values):
            v.assign(x)
        return [v.read_value() for v in variables]
    with tf.control_dependencies([v.assign(x, read_value=False)
                                  for v, x in zip(variables, values)]):
        return [v.read_value() for v in variables]


# ----------------------------------------------------------------------------- alltoall
@_plain
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Rank i sends rows ``splits[j]`` of ``tensor`` to rank j (default: equal parts).
    Returns the rows received, and with ``splits`` also how many came from each rank."""
    sc = _bridge.scope(process_set, "alltoall")
    x = tf.convert_to_tensor(tensor)
    sp = tf.constant([], tf.int32) if splits is None else tf.cast(tf.convert_to_tensor(splits),
                                                                  tf.int32)

    def fn(sc_, a, s):
        out, received = _core.np_alltoall(sc_.comm, a, s if s.size else None)
        return [out, received.astype(np.int32)]

    @tf.custom_gradient
    def f(t, s):
        out, received = _bridge.run("alltoall", fn, [t, s], [t.dtype, tf.int32],
                                    [_gathered(t), tf.TensorShape([sc.size])],
                                    process_set=process_set, check=_check_alltoall,
                                    name=_bridge.graph_name("HorovodAlltoall", [t], name),
                                    ignore_name_scope=ignore_name_scope)

        def grad(d_out, d_received=None):
            g, _ = alltoall(tf.convert_to_tensor(d_out), splits=received,
                            ignore_name_scope=ignore_name_scope, process_set=process_set)
            return [g, None]
        return [out, received], grad
    out, received = f(x, sp)
    return out if splits is None else (out, received)


# ----------------------------------------------------------------------------- reducescatter
def _scattered(t: tf.Tensor, sc) -> tf.TensorShape | None:
    if not t.shape.rank:
        return None
    n = t.shape[0]
    rows = None if n is None else split_rows(int(n), sc.size)[sc.rank]
    return tf.TensorShape([rows]).concatenate(t.shape[1:])


@_plain
def _reducescatter(tensor, name=None, op=Sum, ignore_name_scope=False,
                   process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over the set's ranks (default op: Sum), then rank r keeps its rows."""
    return _grouped_reducescatter([tensor], name, op, ignore_name_scope, process_set,
                                  prescale_factor, postscale_factor, kind="reducescatter")[0]


@_plain
def _grouped_reducescatter(tensors, name=None, op=Sum, ignore_name_scope=False,
                           process_set=global_process_set, prescale_factor=1.0,
                           postscale_factor=1.0, kind="grouped_reducescatter"):
    """``_reducescatter`` of every tensor of ``tensors`` as one collective."""
    sc = _bridge.scope(process_set, kind)
    pre, post = float(prescale_factor), float(postscale_factor)
    xs = [tf.convert_to_tensor(t) for t in tensors]
    prefix = "HorovodReducescatter" if kind == "reducescatter" else "HorovodGroupedReducescatter"

    @tf.custom_gradient
    def f(*ts):
        ys = _bridge.run(kind, lambda sc_, *arrays: [
            np_reducescatter(sc_.comm, a, op, pre, post) for a in arrays], list(ts),
            [t.dtype for t in ts], [_scattered(t, sc) for t in ts], op=op,
            process_set=process_set, check=_no_scalars(kind), ignore_name_scope=ignore_name_scope,
            name=_bridge.graph_name(prefix, list(ts), name))

        def grad(*dys):
            # Horovod's: the upstream gradient times size (Sum) and the scale factors,
            # gathered from every rank.
            gs = _upstream(dys, ys)
            factor = (sc.size if op == Sum else 1) * pre * post
            return [allgather(g * tf.cast(factor, g.dtype) if factor != 1 else g,
                              ignore_name_scope=ignore_name_scope, process_set=process_set)
                    for g in gs]
        return ys, grad
    return list(f(*xs)) if xs else []


# ----------------------------------------------------------------------------- join, queries
@_plain
def join():
    """This rank has no more data: take part in the other ranks' allreduces and
    broadcasts with zeros until every rank has joined. Returns (a tensor of) the rank
    that joined last."""
    return _bridge.local("join", lambda: _core.job("join").engine.join(), tf.int32, "HorovodJoin")


def size_op(process_set_id=0, name=None):
    """The number of ranks in the process set (a tensor), on every rank, as Horovod's."""
    return tf.constant(len(_core.process_set_ranks(process_set_id, "size_op")), tf.int32,
                       name=name)


def rank_op(name=None):
    """This process's rank (a tensor)."""
    return tf.constant(_core.rank(), tf.int32, name=name)


def local_size_op(name=None):
    """The number of ranks on this host (a tensor)."""
    return tf.constant(_core.local_size(), tf.int32, name=name)


def local_rank_op(name=None):
    """This process's rank among the ranks on its host (a tensor)."""
    return tf.constant(_core.local_rank(), tf.int32, name=name)


# Horovod's codes for process_set_included_op.
_SET_ERROR_INIT, _SET_ERROR_UNKNOWN = -1, -3


def process_set_included_op(process_set_id=0, name=None):
    """1 if this rank is in the process set, 0 if not; Horovod's error codes otherwise
    (-1: not initialized, -3: unknown set)."""
    if not _core.is_initialized():
        value = _SET_ERROR_INIT
    else:
        sets = _core.job("process_set_included_op").sets
        value = _SET_ERROR_UNKNOWN if process_set_id not in sets else int(
            sets[process_set_id] is not None)
    return tf.constant(value, tf.int32, name=name)
