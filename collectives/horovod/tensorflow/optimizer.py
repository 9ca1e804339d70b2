"""``horovod.tensorflow.DistributedOptimizer``: one entry for every kind of optimizer, a
TensorFlow 1 one (``tf1.py``) or a Keras one (``keras/optimizer.py``); both build on
``training.py``'s reduction. Imports TensorFlow, never torch.
"""

from __future__ import annotations

import tensorflow as tf

from .. import _core
from .._core import Average, global_process_set
from ..keras.optimizer import wrap
from . import Compression
from .tf1 import DistributedOptimizerV1
from .training import reduction


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",  # noqa: N802
                         device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True):
    """``optimizer`` whose gradients are averaged (``op=Average``) or summed over the
    process set's ranks before they are applied: a TensorFlow 1 optimizer
    (``tf.compat.v1.train.Optimizer``: ``compute_gradients`` reduces) or a Keras one
    (``collectives.horovod.keras.DistributedOptimizer``). ``backward_passes_per_step=N``
    sums N passes' gradients locally and reduces and applies every N-th."""
    how = reduction(op, compression, sparse_as_dense, gradient_predivide_factor, num_groups,
                    groups, process_set, scale_local_gradients)
    if op == _core.Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if op == _core.Adasum:
            # Horovod's TF1 Adasum optimizer reduces each step's weight change, not the
            # gradients: for adaptive optimizers the two differ, so refuse, never approximate.
            raise ValueError("DistributedOptimizer(op=Adasum) with a tf.compat.v1 optimizer "
                             "(Horovod's delta-reducing Adasum optimizer) is not provided; use "
                             "op=Average, or Adasum on the gradients through "
                             "DistributedGradientTape(op=hvd.Adasum)")
        return DistributedOptimizerV1(optimizer, name, use_locking, how,
                                      int(backward_passes_per_step),
                                      average_aggregated_gradients)
    if op == _core.Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    return wrap(optimizer, name, how, int(backward_passes_per_step),
                average_aggregated_gradients)

