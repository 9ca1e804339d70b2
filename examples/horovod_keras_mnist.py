"""Horovod's Keras MNIST example on dtrun, for Keras 3: only the import differs.

    import dtrun.collectives.horovod.keras as hvd     # was: import horovod.tensorflow.keras as hvd

The data is made here (10 classes of noisy 16x16 stroke patterns; nothing is downloaded).

    dtrun -np 2 -H localhost:2 python examples/horovod_keras_mnist.py
    # Horovod's line was: horovodrun -np 2 -H localhost:2 python keras_mnist.py
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import dtrun.collectives.horovod.keras as hvd  # noqa: E402

CLASSES, SIDE = 10, 16


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    protos = (np.random.default_rng(0).random((CLASSES, SIDE, SIDE)) > 0.75).astype(np.float32)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    x = protos[y] + 0.5 * rng.standard_normal((n, SIDE, SIDE)).astype(np.float32)
    return x[..., None], y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()

    hvd.init()
    x, y = make_data(2048, seed=1)
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]  # this rank's shard
    x_test, y_test = make_data(1000, seed=2)

    model = keras.Sequential([
        keras.Input((SIDE, SIDE, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(CLASSES)])
    # Horovod: scale the learning rate by the number of ranks; average the gradients.
    scaled_lr = 0.002 * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),   # everyone starts from rank 0
        hvd.callbacks.MetricAverageCallback(),               # logs averaged over ranks
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1),
    ]
    model.fit(x, y, batch_size=32, epochs=args.epochs, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)
    loss, acc = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"test accuracy {100 * acc:.1f}%")


if __name__ == "__main__":
    main()
