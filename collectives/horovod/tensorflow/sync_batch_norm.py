"""Horovod's ``SyncBatchNormalization`` for TensorFlow/Keras 3: batch statistics of the
global batch. The per-channel sums, sums of squares and row count go through one
differentiable allreduce, so forward and backward equal ``BatchNormalization`` on the
concatenated batch. Masked inputs, or one rank, take Keras' own path."""

from __future__ import annotations

import keras
import tensorflow as tf

from .. import _core
from .mpi_ops import Sum, _allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training statistics cover every rank."""

    def _moments(self, inputs, mask):
        if mask is not None or _core.size() == 1:
            return super()._moments(inputs, mask)
        x = tf.cast(inputs, tf.float64)
        axes = list(self._reduction_axes)
        shape = tf.shape(x)
        n = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), tf.float64)
        local = tf.concat([tf.reduce_sum(x, axes), tf.reduce_sum(x * x, axes),
                           tf.reshape(n, [1])], axis=0)
        total = _allreduce(local, op=Sum)
        c = tf.shape(local)[0] // 2
        count = total[-1]
        mean = total[:c] / count
        var = tf.maximum(total[c:2 * c] / count - mean * mean, 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(var, inputs.dtype)
