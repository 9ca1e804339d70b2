"""Rank program for tests/test_horovod_keras_fidelity.py: run under ``dtrun -np N``.

``python tests/horovod_keras_fidelity_cases.py CASE OUT``, CASE one of:

* ``keras`` (run once with Keras 3, once under ``TF_USE_LEGACY_KERAS=1`` with tf_keras):
  ``model.fit`` with ``DistributedOptimizer`` (tf_keras: its new and its legacy SGD),
  with ``backward_passes_per_step=2`` (summed, then averaged), and with
  ``PartialDistributedOptimizer``, with Horovod's callbacks;
* ``tape``: ``PartialDistributedGradientTape``, ``register_local_source``,
  ``sparse_as_dense``, ``op=Sum``, ``process_set=``, fp16 compression with
  ``gradient_predivide_factor``;
* ``tf1``: a TensorFlow 1 graph trained as Horovod's README shows (Adagrad in
  ``DistributedOptimizer``, ``MonitoredTrainingSession``,
  ``BroadcastGlobalVariablesHook(0)``), also with ``backward_passes_per_step=2``.

Every rank trains on its own rows and checks its weights against a simulation in one
process of every rank's training (``simulate``: each simulated rank's gradients, shared
ones averaged, local ones its own divided by N). Each rank prints ``RESULT {json}`` and
writes its trained weights to ``OUT/CASE.R.npz``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dtrun.collectives.horovod.keras as hvdk  # noqa: E402
import dtrun.collectives.horovod.tensorflow as hvd  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
ROWS = 4  # per rank
LR = 0.1
failures: list[str] = []
saved: dict[str, np.ndarray] = {}


def rows(r: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rank r's inputs and targets (every rank can compute every rank's)."""
    rng = np.random.RandomState(100 * seed + r)
    return rng.rand(ROWS, 3).astype("float32"), rng.rand(ROWS, 2).astype("float32")


def start_weights(shapes) -> list[np.ndarray]:
    return [np.linspace(-1, 1, int(np.prod(s)), dtype="float32").reshape(s) for s in shapes]


def check(what: str, got, want, rtol=1e-5, atol=1e-6) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
        failures.append(f"{what}: {got.ravel()[:4]} != {want.ravel()[:4]}")


def simulate(grads_of, weights, steps, local=(), passes=1, average=False) -> list:
    """Every rank's weights after ``steps`` plain-SGD steps, in one process.
    ``grads_of(r, weights)``: rank r's gradients at ``weights``; ``local``: indices of
    the weights whose gradients stay on each rank (divided by N)."""
    ws = [[w.copy() for w in weights] for _ in range(N)]
    sums = [[np.zeros_like(w) for w in weights] for _ in range(N)]
    for step in range(steps):
        grads = [grads_of(r, ws[r]) for r in range(N)]
        for r in range(N):
            for i, g in enumerate(grads[r]):
                sums[r][i] += g if i in local else sum(gr[i] for gr in grads) / N
        if (step + 1) % passes:
            continue
        for r in range(N):
            for i in range(len(weights)):
                g = sums[r][i] / (N if i in local else 1) / (passes if average else 1)
                ws[r][i] = ws[r][i] - LR * g
                sums[r][i][...] = 0
    return ws


# ----------------------------------------------------------------------------- Keras
def keras_model(keras):
    model = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(2)])
    model.set_weights(start_weights([w.shape for w in model.get_weights()]))
    return model


def keras_grads(keras):
    """``grads_of`` for ``simulate``: rank r's mean-squared-error gradients."""
    def grads_of(r, weights):
        model = keras_model(keras)
        model.set_weights(weights)
        x, y = rows(r)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    return grads_of


def keras_fit(keras, tag, make_opt, steps, local_layers=0, passes=1, average=False):
    """Fit on this rank's rows with the distributed optimizer ``make_opt(model)`` and
    compare with the simulation; save the weights as ``tag``."""
    model = keras_model(keras)
    model.compile(loss="mse", optimizer=make_opt(model))
    x, y = rows(R)
    local_vars = [v for layer in model.layers[:local_layers] for v in layer.variables]
    callbacks = [hvdk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local_vars),
                 hvdk.callbacks.MetricAverageCallback()]
    model.fit(x, y, batch_size=ROWS, epochs=steps, shuffle=False, verbose=0,
              callbacks=callbacks)
    local = set(range(2 * local_layers))  # each Dense layer: kernel, bias
    want = simulate(keras_grads(keras), start_weights([w.shape for w in model.get_weights()]),
                    steps, local, passes, average)[R]
    for i, (got, w) in enumerate(zip(model.get_weights(), want)):
        check(f"{tag} weight {i}", got, w)
        saved[f"{tag}.{i}"] = got
    iterations = int(np.asarray(model.optimizer.iterations))
    if iterations != steps:
        failures.append(f"{tag}: optimizer.iterations {iterations} after {steps} steps")


def case_keras() -> dict:
    keras = tf.keras
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    sgds = [("sgd", keras.optimizers.SGD)]
    if legacy:
        sgds.append(("legacy_sgd", keras.optimizers.legacy.SGD))
    for name, sgd in sgds:
        keras_fit(keras, name, lambda m: hvdk.DistributedOptimizer(sgd(LR)), 3)
        for average in (False, True):
            keras_fit(keras, f"{name}.passes2.{average}", lambda m: hvdk.DistributedOptimizer(
                sgd(LR), backward_passes_per_step=2, average_aggregated_gradients=average),
                4, passes=2, average=average)
        keras_fit(keras, f"{name}.partial", lambda m: hvdk.PartialDistributedOptimizer(
            sgd(LR), local_layers=[m.layers[0]]), 3, local_layers=1)
    return {"keras": keras.__name__ if hasattr(keras, "__name__") else str(keras)}


# ----------------------------------------------------------------------------- tapes
def case_tape() -> dict:
    keras = tf.keras
    model = keras_model(keras)
    x, y = rows(R)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[1],
                                              process_set=hvd.global_process_set)
    got = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    every = [keras_grads(keras)(r, model.get_weights()) for r in range(N)]
    for i, g in enumerate(got):
        want = every[R][i] / N if i >= 2 else sum(e[i] for e in every) / N
        check(f"partial tape grad {i}", g, want)
    # register_local_source, op=Sum, and an IndexedSlices gradient (tf.gather)
    table = tf.Variable(np.arange(12, dtype="float32").reshape(6, 2))
    scale = tf.Variable([1.0, 2.0])
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, [R, R + 2]) * scale) * (R + 1)
        tape = hvd.DistributedGradientTape(tape, op=hvd.Sum, sparse_as_dense=sparse_as_dense)
        tape.register_local_source(scale)
        g_table, g_scale = tape.gradient(loss, [table, scale])
        want = np.zeros((6, 2), "float32")
        for r in range(N):
            want[[r, r + 2]] += (r + 1) * np.array([1.0, 2.0])
        check(f"sparse_as_dense={sparse_as_dense} table", tf.convert_to_tensor(g_table), want)
        own = (R + 1) * (np.arange(12).reshape(6, 2)[[R, R + 2]].sum(0))
        check(f"sparse_as_dense={sparse_as_dense} local scale", g_scale, own / N)
        if sparse_as_dense and isinstance(g_table, tf.IndexedSlices):
            failures.append("sparse_as_dense=True returned IndexedSlices")
    process_sets(model, every)
    return {}


def process_sets(model, every) -> None:
    """``process_set=``: a set of every rank averages; a set of rank 0 alone leaves each
    rank's gradients as they are (rank 0: a set of one; the others: not members)."""
    everyone, alone = hvd.add_process_set(list(range(N))), hvd.add_process_set([0])
    x, y = rows(R)
    for ps, tag in ((everyone, "every rank"), (alone, "rank 0 alone")):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape, process_set=ps)
        for i, g in enumerate(tape.gradient(loss, model.trainable_variables)):
            want = sum(e[i] for e in every) / N if ps is everyone else every[R][i]
            check(f"process set of {tag}: grad {i}", g, want)
    # fp16 on the wire and Horovod's predivide (g / 2 summed, then * 2 / N): the average
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16,
                                       gradient_predivide_factor=2.0)
    for i, g in enumerate(tape.gradient(loss, model.trainable_variables)):
        check(f"fp16, predivide 2: grad {i}", g, sum(e[i] for e in every) / N, rtol=2e-3,
              atol=1e-3)


# ----------------------------------------------------------------------------- TF1
def tf1_graph(passes: int) -> tuple[np.ndarray, np.ndarray]:
    """README-style TF1 training: ranks start from different weights (the hook makes them
    root's) and train on their rows; also the reference (every rank's rows, root's start,
    plain Adagrad applied every ``passes`` steps on the summed gradients) in the same graph."""
    v1 = tf.compat.v1
    w0 = np.linspace(-1, 1, 6, dtype="float32").reshape(3, 2)
    every = [rows(r) for r in range(N)]
    graph = tf.Graph()
    with graph.as_default():
        train = {}
        for tag in ("dist", "ref"):
            with v1.variable_scope(tag):
                w = v1.get_variable("w", initializer=w0 + (R if tag == "dist" else 0))
                if tag == "dist":
                    x, y = rows(R)
                    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
                    opt = hvd.DistributedOptimizer(v1.train.AdagradOptimizer(LR),
                                                   backward_passes_per_step=passes)
                else:  # the whole batch's gradient, summed over the passes
                    x = np.concatenate([e[0] for e in every])
                    y = np.concatenate([e[1] for e in every])
                    loss = passes * tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
                    opt = v1.train.AdagradOptimizer(LR)
                train[tag] = (opt.minimize(loss, global_step=v1.train.get_or_create_global_step()
                                           if tag == "dist" else None), w)
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with v1.train.MonitoredTrainingSession(hooks=hooks, log_step_count_steps=None,
                                               save_summaries_steps=None) as sess:
            for step in range(4):
                sess.run(train["dist"][0])
                if (step + 1) % passes == 0:
                    sess.run(train["ref"][0])
            got, want, step = sess.run([train["dist"][1], train["ref"][1],
                                        v1.train.get_global_step()])
    if step != 4:
        failures.append(f"tf1 passes={passes}: global_step {step} after 4 steps")
    return got, want


def case_tf1() -> dict:
    tf.compat.v1.disable_eager_execution()
    for passes in (1, 2):
        got, want = tf1_graph(passes)
        check(f"tf1 passes={passes}", got, want)
        saved[f"tf1.{passes}"] = got
    return {}


if __name__ == "__main__":
    case, out = sys.argv[1], sys.argv[2]
    extra = {"keras": case_keras, "tape": case_tape, "tf1": case_tf1}[case]()
    np.savez(os.path.join(out, f"{case}.{R}.npz"), **saved)
    print("RESULT " + json.dumps({"rank": R, "size": N, "failures": failures, **extra}),
          flush=True)
