"""``horovod.tensorflow.elastic`` on dtrun's restarts: ``run``, ``TensorFlowKerasState``,
``TensorFlowState`` and ``ObjectState``.

``state.commit()`` keeps the variables' values (and the other attributes) in memory and,
when dtrun restarts the run, on each host's disk as NumPy arrays; after a lost host or a
change of hosts the next attempt resumes from the newest commit
(collectives/horovod/_elastic.py says how). ``TensorFlowKerasState`` needs eager execution
(TensorFlow 2); ``TensorFlowState`` also works in a ``tf.compat.v1`` graph, through its
session. Imports TensorFlow, never Keras nor torch.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import tensorflow as tf

from .. import _core
from .._elastic import ObjectState, run_fn
from . import init, shutdown  # the package's: imported last by it, once these exist
from .functions import broadcast_object, broadcast_variables
from .util import _executing_eagerly

__all__ = ["TensorFlowKerasState", "TensorFlowState", "ObjectState", "run"]


def run(func: Callable) -> Callable:
    """Decorator for the elastic training function ``func(state, ...)``: it starts from the
    newest commit of the run (on any host), synchronised from rank 0, and again after each
    reset. Collectives must not run outside it once the job may change."""
    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as e:
            # Inside a graph a collective runs in tf.py_function, which reports the runtime's
            # HorovodInternalError as an Unknown status carrying its name.
            if "HorovodInternalError" in (e.message or ""):
                raise _core.HorovodInternalError("elastic.run", None, e.message) from e
            raise
    return run_fn(wrapper, _reset)


def _reset() -> None:
    shutdown()
    init()


def _optimizer_variables(optimizer) -> list:
    if optimizer is None:
        return []
    vs = optimizer.variables  # Keras 3 and tf_keras's optimizers: a list; legacy ones: a method
    return list(vs() if callable(vs) else vs)


def _build_optimizer(optimizer, model, wanted: int) -> None:
    """Create the optimizer's slot variables when a commit holds them and this process's
    optimizer has not made them yet (an attempt resuming before its first step): Keras makes
    them at the first ``apply``, too late for ``restore``."""
    if optimizer is None or len(_optimizer_variables(optimizer)) >= wanted:
        return
    if hasattr(optimizer, "_create_all_weights"):  # tf_keras's legacy optimizers
        optimizer._create_all_weights(model.trainable_variables)
    elif hasattr(optimizer, "build"):
        optimizer.build(model.trainable_variables)


class _Variables:
    """The saved values of a list of variables: read and written eagerly, or through a
    ``tf.compat.v1`` session (``session``), where the broadcast is one op built once."""

    def __init__(self, variables: Callable[[], list], session=None):
        self.variables = variables
        self.session = session
        self.saved: list = []
        if session is not None:  # the graph's ops, built once
            vs = variables()
            self._bcast_op = broadcast_variables(vs, root_rank=0)
            self._feeds = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in vs]
            self._assign_op = tf.group(*[v.assign(f, read_value=False) for v, f in zip(vs, self._feeds)])

    def save(self) -> None:
        vs = self.variables()
        if self.session is None:
            self.saved = [tf.identity(v) for v in vs]  # a copy: later steps do not change it
        else:
            self.saved = self.session.run(list(vs))

    def restore(self) -> None:
        vs = self.variables()
        if len(self.saved) > len(vs) or (self.session is not None and len(self.saved) != len(vs)):
            raise ValueError(f"elastic state: {len(self.saved)} values saved for {len(vs)} variables "
                             "(the variables are not those of the commit)")
        if self.session is not None:
            self.session.run(self._assign_op, dict(zip(self._feeds, self.saved)))
            return
        # Fewer values than variables: saved before the optimizer made its slots (as Horovod,
        # those keep their values).
        for v, value in zip(vs, self.saved):
            v.assign(value)

    def sync(self) -> None:
        if self.session is None:
            broadcast_variables(self.variables(), root_rank=0)
        else:
            self.session.run(self._bcast_op)

    def snapshot(self) -> list:
        return [np.array(v) for v in self.saved]


class TensorFlowKerasState(ObjectState):
    """State of a TensorFlow Keras model and optimizer (Horovod's): the model's and the
    optimizer's variables, and each other keyword argument as an attribute.

    Args:
        model: a built Keras model.
        optimizer: the optimizer (default: the model's, as compiled).
        backend: accepted for Horovod's TensorFlow 1 form; only eager execution is supported.
        kwargs: other values to keep, each an attribute (``epoch=0, batch=0``).
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs: Any):
        if not _executing_eagerly():
            raise ValueError("TensorFlowKerasState needs eager execution (TensorFlow 2); in a "
                             "tf.compat.v1 graph use hvd.elastic.TensorFlowState(variables, session)")
        if hasattr(model, "build") and not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or getattr(model, "optimizer", None)
        self.backend = backend
        self._model_values = _Variables(lambda: list(self.model.variables))
        self._optimizer_values = _Variables(lambda: _optimizer_variables(self.optimizer))
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=_core.rank, **kwargs)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        _build_optimizer(self.optimizer, self.model, len(self._optimizer_values.saved))
        self._model_values.restore()
        self._optimizer_values.restore()
        super().restore()

    def sync(self) -> None:
        self._model_values.sync()
        self._optimizer_values.sync()
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        self._model_values.save()
        self._optimizer_values.save()

    def _snapshot(self) -> Any:
        return {"objects": self._saved_state, "model": self._model_values.snapshot(),
                "optimizer": self._optimizer_values.snapshot()}

    def _load_snapshot(self, snap: Any) -> None:
        super()._load_snapshot(snap)
        self._model_values.saved = list(snap["model"])
        self._optimizer_values.saved = list(snap["optimizer"])


class TensorFlowState(ObjectState):
    """State of a list of TensorFlow variables (Horovod's), and each other keyword argument
    as an attribute.

    Args:
        variables: the ``tf.Variable`` objects to keep (default: the graph's global variables,
            in a ``tf.compat.v1`` graph).
        session: in a ``tf.compat.v1`` graph, the session that holds their values (default:
            the default session).
        kwargs: other values to keep, each an attribute.
    """

    def __init__(self, variables=None, session=None, **kwargs: Any):
        eager = _executing_eagerly()
        self.variables = list(variables or ([] if eager else tf.compat.v1.global_variables()))
        self.session = None if eager else session or tf.compat.v1.get_default_session()
        if not eager and self.session is None:
            raise ValueError("TensorFlowState in a tf.compat.v1 graph needs its session: pass session= "
                             "or create the state inside `with session.as_default():`")
        self._values = _Variables(lambda: self.variables, self.session)
        self._values.save()
        super().__init__(bcast_object=broadcast_object, get_rank=_core.rank, **kwargs)

    def save(self) -> None:
        self._values.save()
        super().save()

    def restore(self) -> None:
        self._values.restore()
        super().restore()

    def sync(self) -> None:
        self._values.sync()
        self._values.save()
        super().sync()

    def _snapshot(self) -> Any:
        return {"objects": self._saved_state, "variables": self._values.snapshot()}

    def _load_snapshot(self, snap: Any) -> None:
        super()._load_snapshot(snap)
        self._values.saved = list(snap["variables"])
