"""``horovod.tensorflow.keras.elastic`` (and ``horovod.keras.elastic``) on dtrun's restarts:
``KerasState``, Horovod's three elastic callbacks, and ``run``.

A Horovod elastic Keras script keeps its model in a ``KerasState(model, epoch=0, batch=0)``,
trains inside ``@hvd.elastic.run`` with ``model.fit(..., epochs=epochs - state.epoch,
callbacks=[UpdateEpochStateCallback(state), UpdateBatchStateCallback(state),
CommitStateCallback(state)])``, and a restarted attempt goes on from the last commit
(collectives/horovod/tensorflow/elastic.py). The callbacks subclass the Keras ``tf.keras``
is, as the rest of ``hvd.callbacks``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..tensorflow.elastic import ObjectState, TensorFlowKerasState, run

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "ObjectState", "run"]

_Callback = tf.keras.callbacks.Callback


class KerasState(TensorFlowKerasState):
    """State of a ``tf.keras`` model and optimizer (default: the model's), and each other
    keyword argument as an attribute."""

    def __init__(self, model, optimizer=None, **kwargs: Any):
        super().__init__(model, optimizer=optimizer, backend=tf.keras.backend, **kwargs)


class CommitStateCallback(_Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of each epoch."""

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        self.backend = tf.keras.backend
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        # The count starts again at each (re)start of training, alike on every rank.
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.commit()

    def commit(self) -> None:
        self.state.commit()


class UpdateBatchStateCallback(_Callback):
    """Sets ``state.batch`` to the number of the batch just done, and to 0 at the end of each
    epoch. As Horovod's, it also shortens ``params['steps']`` of the first epoch after a reset
    by ``state.batch``; Keras runs as many steps as its data gives, so a script that resumes
    mid-epoch skips the batches already done itself."""

    def __init__(self, state):
        super().__init__()
        self.backend = tf.keras.backend
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(_Callback):
    """Sets ``state.epoch`` to the number of epochs done across resets (Keras counts from 0 in
    each ``fit``): put it before ``CommitStateCallback`` so that an epoch's commit holds it."""

    def __init__(self, state):
        super().__init__()
        self.backend = tf.keras.backend
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        # +1: the epoch is done; a reset after it does not run it again.
        self.state.epoch = self.initial_epoch + epoch + 1
