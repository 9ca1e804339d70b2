"""Horovod's variable and object helpers for TensorFlow (``horovod.tensorflow.functions``):
broadcasting variables and picklable objects. In a graph ``broadcast_variables`` returns the op that assigns root's values (run
it), as Horovod's; eager, it assigns them at once.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from .. import _core
from .._core import global_process_set
from .mpi_ops import broadcast


# Called inside tf.function, these run as plain Python (AutoGraph leaves them alone).
_plain = tf.autograph.experimental.do_not_convert


def _assign(v, value):
    """``v.assign(value)``; in a graph the assign op itself (what ``tf.group`` takes)."""
    if not tf.executing_eagerly() and isinstance(v, tf.Variable):
        return v.assign(value, read_value=False)
    return v.assign(value)


@_plain
def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign rank ``root_rank``'s values to ``variables`` on every rank of the set: one
    broadcast per dtype. Eager: done on return (returns None); in a graph: returns the op
    that does it. ``inplace`` is accepted (every assignment is in place here)."""
    by_dtype: dict[Any, list] = {}
    for v in variables:
        by_dtype.setdefault(tf.as_dtype(v.dtype), []).append(v)  # Keras 3: a string
    assigns = []
    for dtype in sorted(by_dtype, key=lambda d: d.name):
        vs = by_dtype[dtype]
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in vs], axis=0)
        flat = broadcast(flat, root_rank, process_set=process_set)
        start = 0
        for v in vs:
            n = tf.TensorShape(v.shape).num_elements()
            assigns.append(_assign(v, tf.reshape(flat[start:start + n], v.shape)))
            start += n
    if tf.executing_eagerly():
        return None
    return tf.group(*assigns)


@_plain
def broadcast_object(obj: Any, root_rank: int = 0, session=None, name=None,
                     process_set=global_process_set) -> Any:
    """Root's picklable ``obj`` on every rank of the set (``session``: unused, nothing
    here runs in a TensorFlow session)."""
    return _core.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank: int = 0, session=None, name=None,
                        process_set=global_process_set):
    """A function ``f(obj)`` returning root's ``obj`` on every rank (Horovod's TF1 form of
    ``broadcast_object``)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


@_plain
def allgather_object(obj: Any, session=None, name=None, process_set=global_process_set) -> list:
    """Every rank's picklable ``obj``, in rank order, on every rank of the set."""
    return _core.allgather_object(obj, name, process_set)
