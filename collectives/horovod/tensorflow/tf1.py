"""TensorFlow 1 style training on dtrun's runtime, as Horovod's README shows it:
``hvd.DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(...))`` (its
``compute_gradients`` averages over ranks), ``hvd.broadcast_global_variables(root_rank)``
and ``hvd.BroadcastGlobalVariablesHook(root_rank)`` for ``MonitoredTrainingSession``.
The collectives run inside the graph, when the session runs them.
"""

from __future__ import annotations

import tensorflow as tf

from . import broadcast
from .aggregation import GradientAggregator
from .training import LocalSources, Reduction, reduce_gradients


class DistributedOptimizerV1(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` around ``optimizer``: ``compute_gradients``
    reduces the gradients over the process set's ranks (locally summed over
    ``backward_passes_per_step`` passes first, graph mode only), the rest is
    ``optimizer``'s."""

    def __init__(self, optimizer, name, use_locking, how: Reduction, passes: int,
                 average_aggregated_gradients: bool):
        name = name or f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._how = how
        self._local = LocalSources()
        self.process_set = how.process_set
        self.scale_local_gradients = how.scale_local_gradients
        self._agg_helper = None
        if passes > 1:
            if tf.executing_eagerly():
                raise ValueError("backward_passes_per_step > 1 is not yet supported for "
                                 "_LegacyOptimizer with eager execution.")
            self._agg_helper = GradientAggregator(passes, average_aggregated_gradients,
                                                  self._reduce, how.sparse_as_dense)

    def _reduce(self, grads, variables) -> list:
        return reduce_gradients(grads, variables, self._how, self._local.ids())

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (not reduced)."""
        self._local.add(var)

    def compute_gradients(self, *args, **kwargs):
        """``optimizer.compute_gradients``, with the gradients reduced over ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        if self._agg_helper is not None:
            reduced = self._agg_helper.compute_gradients(grads, variables)
        else:
            reduced = self._reduce(grads, variables)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """``optimizer.apply_gradients`` (every ``backward_passes_per_step``-th pass)."""
        if self._agg_helper is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name)
        grads_and_vars = list(grads_and_vars)
        return self._agg_helper.apply_gradients(
            lambda: self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                    name=name),
            global_step=global_step, after=[g for g, _ in grads_and_vars if g is not None])

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def broadcast_global_variables(root_rank):
    """An operation that assigns root's values to every global variable of the default
    graph (TensorFlow 1 graph mode; eagerly, use ``broadcast_variables``)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return assign_from_root(tf.compat.v1.global_variables(), root_rank,
                            "broadcast_global_variables")


def assign_from_root(variables, root_rank, name: str):
    """One graph operation that assigns root's values to ``variables``: one named
    broadcast per dtype (the names pair the collectives across ranks whatever order
    the session runs them in)."""
    by_dtype: dict = {}
    for v in variables:
        by_dtype.setdefault(v.dtype.base_dtype, []).append(v)
    assigns = []
    for dtype in sorted(by_dtype, key=lambda d: d.name):
        vs = by_dtype[dtype]
        flat = tf.concat([tf.reshape(v.read_value() if hasattr(v, "read_value") else v, [-1])
                          for v in vs], axis=0)
        flat = broadcast(flat, root_rank, name=f"{name}.{dtype.name}.{len(vs)}")
        sizes = [v.shape.num_elements() for v in vs]
        for v, part in zip(vs, tf.split(flat, sizes)):
            assigns.append(tf.compat.v1.assign(v, tf.reshape(part, v.shape)))
    return tf.group(*assigns)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A ``SessionRunHook`` that assigns root's values to every global variable once the
    session exists (consistent starting weights, random or restored from a checkpoint)."""

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
