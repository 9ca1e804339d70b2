"""Horovod's TensorFlow 2 MNIST example (a GradientTape loop) on dtrun: only the import differs.

    import dtrun.collectives.horovod.tensorflow as hvd     # was: import horovod.tensorflow as hvd

    dtrun -np 2 -H localhost:2 python examples/horovod_tensorflow2_mnist.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import dtrun.collectives.horovod.tensorflow as hvd  # noqa: E402
from horovod_keras_mnist import CLASSES, SIDE, make_data  # noqa: E402


def main() -> None:
    hvd.init()
    x, y = make_data(2048, seed=1)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(hvd.size(), hvd.rank()) \
        .repeat().shuffle(1000, seed=hvd.rank()).batch(32)
    model = keras.Sequential([
        keras.Input((SIDE, SIDE, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(CLASSES)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(0.001 * hvd.size())

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)   # gradients averaged over ranks
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:  # after the first step the optimizer's variables exist
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    for batch, (images, labels) in enumerate(ds.take(200 // hvd.size())):
        loss = training_step(images, labels, batch == 0)
        if batch % 20 == 0 and hvd.rank() == 0:
            print(f"step {batch}: loss {float(loss):.4f}", flush=True)
    x_test, y_test = make_data(1000, seed=2)
    acc = float(tf.reduce_mean(tf.cast(tf.argmax(model(x_test), 1) == y_test, tf.float32)))
    if hvd.rank() == 0:
        print(f"test accuracy {100 * acc:.1f}%")


if __name__ == "__main__":
    main()
