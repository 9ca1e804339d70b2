"""Horovod's Keras callbacks (``hvd.callbacks.*``), for Keras 3."""

from __future__ import annotations

import keras
import numpy as np

from .. import tensorflow as _hvd


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Every rank starts from root's weights: the model's variables are broadcast when
    training begins, and the model's and optimizer's after the first batch (when the
    optimizer's variables exist), as Horovod's callback does."""

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local = set()

    def register_local_var(self, var) -> None:
        """Keep ``var`` out of the broadcast (a worker-local variable)."""
        self._local.add(id(var))

    def _variables(self, with_optimizer: bool) -> list:
        vs = [v for v in self.model.variables if id(v) not in self._local]
        if with_optimizer and getattr(self.model, "optimizer", None) is not None:
            vs += [v for v in self.model.optimizer.variables if id(v) not in self._local]
        return vs

    def on_train_begin(self, logs=None):
        _hvd.broadcast_variables(self._variables(False), root_rank=self.root_rank)

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        _hvd.broadcast_variables(self._variables(True), root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, every metric in ``logs`` becomes its average over ranks
    (in sorted name order on every rank)."""

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        for name in sorted(logs):
            value = np.asarray(logs[name], dtype=np.float64)
            logs[name] = float(_hvd.allreduce(value, op=_hvd.Average,
                                              name=f"metric.{name}").numpy())


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Learning rate = ``initial_lr * multiplier(epoch)`` between ``start_epoch`` and
    ``end_epoch`` (per batch unless ``staircase``), with Horovod's momentum correction."""

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
        return float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def _adjust(self, epoch: float) -> None:
        opt = self.model.optimizer
        old = self._lr()
        new = self.initial_lr * self.multiplier(epoch)
        opt.learning_rate.assign(new)
        if self.momentum_correction and getattr(opt, "momentum", None):
            self.restore_momentum = opt.momentum
            opt.momentum = self.restore_momentum * new / old

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError("Could not autodetect the number of steps per epoch; pass "
                                 f"steps_per_epoch to {type(self).__name__}()")

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
            self.model.optimizer.momentum = self.restore_momentum
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
