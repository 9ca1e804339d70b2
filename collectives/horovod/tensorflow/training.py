"""The training half of ``horovod.tensorflow`` on dtrun's runtime: the gradient reduction
every wrapper shares, ``DistributedGradientTape``, ``PartialDistributedGradientTape`` and
``DistributedOptimizer`` (re-exported by ``collectives.horovod.tensorflow``).

``DistributedOptimizer`` takes what Horovod's takes: a TensorFlow 1 optimizer
(``tf.compat.v1.train.Optimizer``, see ``tf1.py``) or a Keras one, Keras 3 or Keras 2
(``tf_keras``, what ``tf.keras`` is under ``TF_USE_LEGACY_KERAS=1``), see
``collectives/horovod/keras/optimizer.py``. Imports TensorFlow, never torch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from .. import _core
from .._core import Average, global_process_set
from . import Compression, grouped_allreduce


@dataclass(frozen=True)
class Reduction:
    """How a wrapper reduces gradients: Horovod's arguments, checked once."""

    op: Any = Average
    compression: Any = Compression.none
    sparse_as_dense: bool = False
    predivide: float = 1.0
    process_set: Any = global_process_set
    scale_local_gradients: bool = True

    def scales(self) -> tuple[float, float]:
        """(prescale, postscale): Horovod's gradient_predivide_factor f sums g / f, then
        multiplies by f / size, which is average(g / f) * f."""
        if self.op == Average and self.predivide != 1.0:
            return 1.0 / self.predivide, self.predivide
        return 1.0, 1.0


def reduction(op, compression, sparse_as_dense, gradient_predivide_factor, num_groups,
              groups, process_set, scale_local_gradients) -> Reduction:
    """Horovod's checks of the gradient arguments, as a ``Reduction``. ``groups`` only
    split the allreduce into several (Horovod's fusion control): one grouped allreduce
    already fuses every gradient, so it is checked and otherwise has no effect."""
    f = float(gradient_predivide_factor)
    if f != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "tf.Variable.")
    return Reduction(op, compression, bool(sparse_as_dense), f,
                     global_process_set if process_set is None else process_set,
                     bool(scale_local_gradients))


def membership(process_set, where: str) -> tuple[bool, int]:
    """(this rank is in the set, the set's size); an unregistered set raises."""
    if not isinstance(process_set, _core.ProcessSet) or process_set.included() is None:
        _core.scope(process_set, where)  # raises the error that says what is wrong
    return bool(process_set.included()), int(process_set.size())


def _divided(grad, n: int):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(n, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad / tf.cast(n, grad.dtype)


def reduce_gradients(grads, sources, how: Reduction, local=frozenset(),
                     where: str = "DistributedOptimizer") -> list:
    """Horovod's reduction of ``grads`` (a list; ``sources`` the matching variables):
    every gradient whose source is not local (``id`` in ``local``) is averaged (or summed)
    over the process set in one grouped allreduce (an ``IndexedSlices`` is gathered, as
    Horovod's allreduce does, unless ``sparse_as_dense``); a local source's gradient stays
    this rank's, divided by the set's size when ``scale_local_gradients`` (Horovod's
    convention). None stays None; on a set of one rank, or where this rank is not a member
    of the set, the shared gradients come back as they are."""
    grads = list(grads)
    if how.sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
    included, n = membership(how.process_set, where)
    out = list(grads)
    shared = [i for i, (g, s) in enumerate(zip(grads, sources))
              if g is not None and id(s) not in local]
    if included and n > 1 and shared:
        pre, post = how.scales()
        reduced = grouped_allreduce([grads[i] for i in shared], op=how.op,
                                    compression=how.compression, prescale_factor=pre,
                                    postscale_factor=post, process_set=how.process_set)
        for i, r in zip(shared, reduced):
            out[i] = r
    if local and how.scale_local_gradients:
        for i, (g, s) in enumerate(zip(grads, sources)):
            if g is not None and id(s) in local:
                out[i] = _divided(g, n)
    return out


def allreduce_gradients(grads, op=Average, compression=Compression.none,
                        gradient_predivide_factor=1.0, process_set=global_process_set):
    """Average (or sum) a list of gradients over ranks in one grouped allreduce; None
    entries stay None."""
    how = reduction(op, compression, False, gradient_predivide_factor, 0, None, process_set,
                    True)
    grads = list(grads)
    return reduce_gradients(grads, [object() for _ in grads], how, where="allreduce_gradients")


class LocalSources:
    """The variables whose gradients a wrapper keeps local (``register_local_source`` /
    ``register_local_var``): ids, with the variables held so that no id is reused."""

    def __init__(self):
        self._vars: dict[int, Any] = {}

    def add(self, var) -> None:
        self._vars[id(var)] = var

    def ids(self) -> frozenset:
        return frozenset(self._vars)

    def __contains__(self, var) -> bool:
        return id(var) in self._vars

    def __len__(self) -> int:
        return len(self._vars)


class _DistributedGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose ``gradient()`` reduces the gradients over ranks
    (``DistributedGradientTape`` makes one of the wrapped tape's class, sharing its
    recording)."""

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = reduce_gradients(tf.nest.flatten(grads), flat_sources, self._hvd_how,
                                self._hvd_local.ids(), "DistributedGradientTape")
        return tf.nest.pack_sequence_as(grads, flat)

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient on this rank (not reduced; divided by the set's size
        when ``scale_local_gradients``)."""
        self._hvd_local.add(source)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """([(local source, gradient)], [(shared source, gradient)]), in sources' order."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        pairs = list(zip(tf.nest.flatten(sources), tf.nest.flatten(grads)))
        return ([(s, g) for s, g in pairs if s in self._hvd_local],
                [(s, g) for s, g in pairs if s not in self._hvd_local])


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",  # noqa: N802
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """A tape like ``gradtape`` (same class, same recording) whose ``gradient()`` averages
    (``op=Average``) or sums the gradients over the process set's ranks."""
    how = reduction(op, compression, sparse_as_dense, gradient_predivide_factor, num_groups,
                    groups, process_set, scale_local_gradients)
    base = type(gradtape)
    cls = base if issubclass(base, _DistributedGradientTape) else \
        type(base.__name__, (_DistributedGradientTape, base), {"__module__": __name__})
    tape = cls(persistent=gradtape._persistent,
               watch_accessed_variables=gradtape._watch_accessed_variables)
    tape._tape = gradtape._tape  # what the wrapped tape recorded (None: not entered yet)
    tape._hvd_how = how
    tape._hvd_local = LocalSources()
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",  # noqa: N802
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """``DistributedGradientTape`` that keeps the gradients of ``local_layers``' trainable
    weights on each rank (registered as local sources)."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for var in local_layer_weights(local_layers):
        tape.register_local_source(var)
    return tape


def local_layer_weights(local_layers) -> list:
    """The trainable weights of ``local_layers`` (None, one Keras layer or a list of them:
    Keras 3's or tf_keras's)."""
    if local_layers is None:
        return []
    if _is_layer(local_layers):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(_is_layer(layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return [v for layer in local_layers for v in layer.trainable_weights]


def _is_layer(obj) -> bool:
    return any(c.__name__ == "Layer" and c.__module__.split(".")[0] in ("keras", "tf_keras")
               for c in type(obj).__mro__)
