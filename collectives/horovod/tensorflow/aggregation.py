"""Horovod's ``backward_passes_per_step``: a distributed optimizer sums the gradients of N
backward passes on each rank, reduces the sums over ranks once every N passes (one
grouped allreduce instead of N) and applies them then; the other passes apply nothing
but still count as steps (the optimizer's ``iterations``, TF1's ``global_step``), as in
Horovod. ``average_aggregated_gradients`` divides the sums by N.

Works eagerly, inside ``tf.function`` (Keras ``fit``) and in TensorFlow 1 graphs, where
the counter decides through ``tf.cond``: every rank runs the same passes, so every rank
takes the same branch and the reduction's collective meets its partners.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf


def _local_variable(initial, name: str):
    """A non-trainable variable outside any function being traced; in a TensorFlow 1
    graph a local variable (initialised by the session's local init, never broadcast)."""
    with tf.init_scope():
        if tf.executing_eagerly():
            return tf.Variable(initial(), trainable=False, name=name)
        return tf.compat.v1.Variable(initial(), trainable=False, name=name, use_resource=True,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])


def _shape(grad, var):
    shape = getattr(var, "shape", None)
    return tf.TensorShape(shape) if shape is not None else grad.shape


def _ops(result) -> list:
    """The tensors and operations in ``result`` (a variable's update: its operation)."""
    out = []
    for x in tf.nest.flatten(result):
        if not isinstance(x, (tf.Tensor, tf.Operation)):
            x = getattr(x, "op", None)
        if isinstance(x, (tf.Tensor, tf.Operation)):
            out.append(x)
    return out


def _after(result) -> tf.Tensor:
    """A tensor that runs after everything in ``result`` (both tf.cond branches must
    return the same structure)."""
    with tf.control_dependencies(_ops(result)):
        return tf.constant(True)


class GradientAggregator:
    """The local sums and the pass counter of one distributed optimizer (Horovod's
    ``_agg_helper``: ``counter`` is the number of passes summed since the last
    reduction)."""

    def __init__(self, passes: int, average: bool, reduce: Callable, sparse_as_dense: bool):
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.passes = passes
        self.average = bool(average)
        self._reduce = reduce  # (grads, variables) -> reduced grads, None kept
        self._sparse_as_dense = sparse_as_dense
        self.counter = None
        self._sums = None

    def _dense(self, grad):
        if isinstance(grad, tf.IndexedSlices):
            if not self._sparse_as_dense:
                raise ValueError("IndexedSlices are not supported when "
                                 "`backward_passes_per_step` > 1 and `sparse_as_dense` is "
                                 "False.")
            return tf.convert_to_tensor(grad)
        return grad

    def _build(self, grads, variables) -> None:
        self.counter = _local_variable(lambda: tf.zeros([], tf.int32), "aggregation_counter")
        self._sums = [None if g is None else _local_variable(
            lambda g=g, v=v: tf.zeros(_shape(g, v), g.dtype), f"aggregated_gradient_{i}")
            for i, (g, v) in enumerate(zip(grads, variables))]

    def compute_gradients(self, grads, variables) -> list:
        """Add this pass's ``grads`` to the sums; on the N-th pass return the reduced sums
        (and clear them), on the others the sums so far (not to be applied)."""
        grads = [None if g is None else self._dense(g) for g in grads]
        variables = list(variables)
        if self._sums is None:
            self._build(grads, variables)
        if len(grads) != len(self._sums):
            raise ValueError(f"backward_passes_per_step: this pass has {len(grads)} gradients, "
                             f"the first had {len(self._sums)}; pass the same variables "
                             "every time")
        idx = [i for i, s in enumerate(self._sums) if s is not None]
        adds = [self._sums[i].assign_add(grads[i]) for i in idx if grads[i] is not None]
        with tf.control_dependencies(adds if not tf.executing_eagerly() else []):
            count = self.counter.assign_add(1)

        def reduced():
            return self._reduce_sums(variables, idx)

        def so_far():
            return [self._sums[i].read_value() for i in idx]
        if tf.executing_eagerly():
            outs = reduced() if int(count) == self.passes else so_far()
        else:
            outs = tf.cond(tf.equal(count, self.passes), reduced, so_far)
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        full = [None] * len(grads)
        for i, o in zip(idx, outs):
            full[i] = o
        return full

    def _reduce_sums(self, variables, idx) -> list:
        sums = [None] * len(variables)
        for i in idx:
            sums[i] = self._sums[i].read_value()
        reduced = self._reduce(sums, variables)
        outs = [reduced[i] for i in idx]
        if self.average:
            outs = [o / tf.cast(self.passes, o.dtype) for o in outs]
        graph = not tf.executing_eagerly()
        with tf.control_dependencies(outs if graph else []):
            clears = [self._sums[i].assign(tf.zeros_like(self._sums[i])) for i in idx]
            clears.append(self.counter.assign(0))
        with tf.control_dependencies(clears if graph else []):
            return [tf.identity(o) for o in outs]

    def apply_gradients(self, apply: Callable, iterations=None, global_step=None, after=()):
        """``apply()`` on the passes that reduced; on the others only count the step.
        ``after``: what the decision must wait for in a graph (the gradients)."""
        if self.counter is None:  # nothing summed through compute_gradients: apply as is
            return apply()

        def skip():
            steps = [c.assign_add(1) for c in (iterations, global_step) if c is not None]
            return steps
        if tf.executing_eagerly():
            return apply() if int(self.counter) == 0 else skip()
        with tf.control_dependencies(_ops(list(after))):
            return tf.cond(tf.equal(self.counter, 0), lambda: _after(apply()),
                           lambda: _after(skip()))
