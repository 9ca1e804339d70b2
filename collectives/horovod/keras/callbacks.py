"""Horovod's Keras callbacks (``hvd.callbacks.*``), for the Keras ``tf.keras`` is: Keras 3,
or Keras 2 (``tf_keras``) under ``TF_USE_LEGACY_KERAS=1`` (as Horovod's, which subclass
``tensorflow.keras.callbacks.Callback``; set the variable before this module is imported).

Learning rates and momenta are read and written through the optimizer's variables where
it has them (Keras 3's and tf_keras's ``learning_rate``, the legacy optimizers'
``momentum``). Keras 3's and tf_keras's new optimizers keep ``momentum`` as a Python
number that a compiled training step reads once, when it is traced: there the momentum
correction changes the attribute but not the steps already traced (as under Horovod).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import tensorflow as _hvd

_Callback = tf.keras.callbacks.Callback


def _value(x) -> float:
    return float(np.asarray(x.numpy() if hasattr(x, "numpy") else x))


def _set(owner, attr: str, value: float) -> None:
    """``owner.attr = value``, through ``assign`` where the attribute is a variable."""
    current = getattr(owner, attr)
    if hasattr(current, "assign"):
        current.assign(value)
    else:
        setattr(owner, attr, value)


def _optimizer_variables(optimizer) -> list:
    vs = optimizer.variables
    return list(vs() if callable(vs) else vs)


def _is_variable(v) -> bool:
    return hasattr(v, "assign") and hasattr(v, "shape") and hasattr(v, "dtype")


class BroadcastGlobalVariablesCallback(_Callback):
    """Every rank starts from root's weights: the model's variables are broadcast when
    training begins (where the model is built by then), and the model's and the
    optimizer's after the first batch (once the optimizer's variables exist), as
    Horovod's callback does at that batch's end.
    ``local_variables`` (or ``register_local_var``) stay each rank's own."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local: dict[int, object] = {}
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        if not all(_is_variable(v) for v in local_variables):
            raise ValueError("All local variables must be of tf.Variable type.")
        for v in local_variables:
            self.register_local_var(v)

    def register_local_var(self, var) -> None:
        """Keep ``var`` out of the broadcast (a worker-local variable)."""
        self._local[id(var)] = var

    def _variables(self, with_optimizer: bool) -> list:
        vs = [v for v in self.model.variables if id(v) not in self._local]
        if with_optimizer and getattr(self.model, "optimizer", None) is not None:
            vs += [v for v in _optimizer_variables(self.model.optimizer)
                   if id(v) not in self._local]
        return vs

    def on_train_begin(self, logs=None):
        # A model built by its first batch has no variables yet: the broadcast at that
        # batch's end (Horovod's only one) is then the first.
        if getattr(self.model, "built", True):
            _hvd.broadcast_variables(self._variables(False), root_rank=self.root_rank)

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        _hvd.broadcast_variables(self._variables(True), root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(_Callback):
    """At each epoch's end, every metric in ``logs`` becomes its average over ranks (one
    allreduce of the metrics in name order: ranks with different metrics get a clear
    mismatch error). Put it before the callbacks that read the metrics."""

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(logs)
        values = np.array([_value(logs[k]) for k in names], dtype=np.float64)
        averaged = _hvd.allreduce(values, op=_hvd.Average,
                                  name=f"MetricAverageCallback.{epoch}").numpy()
        for k, v in zip(names, averaged):
            logs[k] = float(v)


class LearningRateScheduleCallback(_Callback):
    """Learning rate = ``initial_lr * multiplier(epoch)`` from ``start_epoch`` up to
    ``end_epoch`` (once per epoch when ``staircase``, else every batch at the fractional
    epoch), with Horovod's momentum correction. A number ``multiplier`` m means
    ``m ** (epoch - start_epoch)``."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else \
            (lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None

    def _lr(self) -> float:
        return _value(self.model.optimizer.learning_rate)

    def _adjust(self, epoch: float) -> None:
        opt = self.model.optimizer
        old = self._lr()
        new = self.initial_lr * self.multiplier(epoch)
        _set(opt, "learning_rate", new)
        if self.momentum_correction and hasattr(opt, "momentum"):
            self.restore_momentum = _value(opt.momentum)
            _set(opt, "momentum", self.restore_momentum * new / old)

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify "
                         f"the steps_per_epoch parameter to the {type(self).__name__}() or "
                         "upgrade to the latest version of Keras.")

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (
                self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(self.current_epoch)
        elif not self.staircase:
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        if self.restore_momentum:
            _set(self.model.optimizer, "momentum", self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self._lr()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's warm-up: from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, adjusted every batch (Goyal et al., 2017)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            n = _hvd.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self._lr():g}.")
