"""Horovod's Keras ``DistributedOptimizer`` on dtrun's runtime, for both Kerases
TensorFlow 2.21 can train with: Keras 3 (``keras``, what ``tf.keras`` is by default) and
Keras 2 (``tf_keras``, what ``tf.keras`` is under ``TF_USE_LEGACY_KERAS=1``: its
optimizers and its legacy ``optimizers.legacy`` ones).

The wrapper is a subclass of the optimizer's own class, of the same name and module (a
saved model loads back without Horovod), made from the optimizer's config (as Horovod's
is: the wrapped optimizer's state is not carried over). Where the gradients are reduced
follows what each Keras's training step calls:

* Keras 2: ``compute_gradients`` / ``_compute_gradients`` (``minimize``, ``fit``) and
  ``get_gradients`` reduce, as in Horovod; ``apply_gradients`` applies what it is given.
* Keras 3 has no gradient hook before ``apply`` (``fit`` calls ``apply_gradients``, which
  calls ``apply``): ``apply`` reduces the gradients it is given, then applies them.

Imports TensorFlow, and Keras only through the optimizer it is given.
"""

from __future__ import annotations

from ..tensorflow.aggregation import GradientAggregator
from ..tensorflow.training import LocalSources, Reduction, reduce_gradients


def flavour(optimizer) -> str | None:
    """"keras3", "keras2" (tf_keras) or None (not a Keras optimizer), from the first
    Keras class among the optimizer's classes (a user's subclass is in neither)."""
    for c in type(optimizer).__mro__:
        root = c.__module__.split(".")[0]
        if root == "tf_keras":
            return "keras2"
        if root == "keras":
            return "keras3" if hasattr(optimizer, "stateless_apply") else "keras2"
    return None


class _Distributed:
    """What both Kerases' wrappers share: the reduction settings, the local variables,
    the ``backward_passes_per_step`` sums (``_agg_helper``)."""

    _hvd_settings: tuple = ()  # (how, passes, average): set on each wrapper class

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        how, passes, average = self._hvd_settings
        self._hvd_how = how
        self._hvd_local = LocalSources()
        self.process_set = how.process_set
        self.scale_local_gradients = how.scale_local_gradients
        self._agg_helper = None
        if passes > 1:
            self._agg_helper = GradientAggregator(passes, average, self._reduce,
                                                  how.sparse_as_dense)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (not reduced; divided by the set's size
        when ``scale_local_gradients``)."""
        self._hvd_local.add(var)

    def _reduce(self, grads, variables) -> list:
        return reduce_gradients(grads, variables, self._hvd_how, self._hvd_local.ids())

    def _allreduce(self, grads, variables) -> list:
        """The gradients to apply: reduced over ranks (with ``backward_passes_per_step``,
        the reduced sums on every N-th pass)."""
        if self._agg_helper is not None:
            return self._agg_helper.compute_gradients(list(grads), list(variables))
        return self._reduce(list(grads), list(variables))


class _Keras2(_Distributed):
    """tf_keras optimizers (``optimizers.Optimizer`` and ``optimizers.legacy``)."""

    def compute_gradients(self, loss, var_list, tape=None):
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        base = super()
        if hasattr(base, "_compute_gradients"):
            pairs = base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        else:
            pairs = base.compute_gradients(loss, var_list, tape=tape)
        pairs = list(pairs)
        if not pairs:
            return pairs
        grads, weights = zip(*pairs)
        return list(zip(self._allreduce(grads, weights), weights))

    def get_gradients(self, loss, params):
        return self._allreduce(super().get_gradients(loss, params), params)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        apply = super().apply_gradients
        if self._agg_helper is None:
            return apply(grads_and_vars, *args, **kwargs)
        grads_and_vars = list(grads_and_vars)
        return self._agg_helper.apply_gradients(
            lambda: apply(grads_and_vars, *args, **kwargs), self.iterations,
            after=[g for g, _ in grads_and_vars if g is not None])


class _Keras3(_Distributed):
    """Keras 3 optimizers."""

    def apply(self, grads, trainable_variables=None):
        apply = super().apply
        if trainable_variables is None and not self.built:
            return apply(grads, trainable_variables)  # Keras's own error
        variables = list(self._trainable_variables if trainable_variables is None
                         else trainable_variables)
        if self._agg_helper is None:
            return apply(self._allreduce(grads, variables), trainable_variables)
        if not self.built:  # as apply() would, before the pass counter decides
            import keras
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        reduced = self._allreduce(grads, variables)
        return self._agg_helper.apply_gradients(
            lambda: apply(reduced, trainable_variables), self.iterations,
            after=[g for g in reduced if g is not None])


def wrap(optimizer, name, how: Reduction, passes: int, average: bool):
    """The distributed copy of the Keras ``optimizer`` (see the module's docstring)."""
    kind = flavour(optimizer)
    if kind is None:
        raise TypeError(f"DistributedOptimizer: {type(optimizer).__name__} is neither a Keras "
                        "optimizer (Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1) nor a "
                        "tf.compat.v1.train.Optimizer")
    if passes > 1 and (getattr(optimizer, "gradient_accumulation_steps", None) or 1) > 1:
        raise ValueError("DistributedOptimizer: pass backward_passes_per_step or the Keras "
                         "optimizer's gradient_accumulation_steps, not both")
    base = type(optimizer)
    mixin = _Keras3 if kind == "keras3" else _Keras2
    cls = type(base.__name__, (mixin, base), {
        "__module__": base.__module__, "__qualname__": base.__qualname__,
        "_hvd_settings": (how, passes, average)})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)
