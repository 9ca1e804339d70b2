"""Rank program for tests/test_horovod_tf.py: run under ``dtrun -np N``.

Written as a Horovod TensorFlow/Keras user writes one (only the imports differ). TensorFlow
starts slowly, so one launch checks everything; every rank checks, against NumPy:

* the collectives on tf.Tensor and tf.Variable, eager and inside tf.function, for each
  dtype Horovod's TensorFlow ops take; the mismatched-shape error (Horovod's
  FailedPreconditionError);
* TF: N ranks x B/N rows with DistributedGradientTape and SyncBatchNormalization against
  one process with BatchNormalization on all B rows (computed on every rank);
* Keras 3: model.fit with DistributedOptimizer and the callbacks against plain fit on
  all B rows; the warm-up's learning rates;
* ``hvd.elastic`` within one attempt: the states synchronised from rank 0, committed and
  restored, ``run``'s restore and reset after a HorovodInternalError (as a graph reports
  it), the Keras callbacks' commits and counters.

Each rank prints one line ``RESULT {json}``; ``OUT/rank.R.npz`` holds the trained weights.
Usage: python tests/horovod_tf_cases.py OUT
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dtrun.collectives.horovod.keras as hvdk  # noqa: E402
import dtrun.collectives.horovod.tensorflow as hvd  # noqa: E402
import horovod_common as common  # noqa: E402 (tests/, this script's folder)
from horovod_common import data  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
failures: list[str] = []
checked = 0
DTYPES = ["uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


def tensor(values: np.ndarray, dtype: str, variable: bool = False):
    t = tf.cast(tf.constant(values), getattr(tf, dtype))
    return tf.Variable(t) if variable else t


def check(what: str, got, want: np.ndarray, dtype: str) -> None:
    global checked
    checked += 1
    common.compare(failures, what, tf.cast(got, tf.float64).numpy(), want, dtype)


def reduce(op, dtype, rows=4):
    return common.reduced(op, dtype, N, rows)


def collectives() -> None:
    graph_ops = {}

    @tf.function
    def in_graph(t, op):  # one trace per dtype/op: collectives inside tf.function
        return hvd.allreduce(t, op=op), hvd.allgather(t), hvd.broadcast(t, N - 1)

    for dtype in DTYPES:
        x = data(R)
        for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
            want = reduce(op, dtype)
            check(f"allreduce {op}", hvd.allreduce(tensor(x, dtype), op=op), want, dtype)
            check(f"allreduce variable {op}", hvd.allreduce(tensor(x, dtype, True), op=op),
                  want, dtype)
            outs = hvd.grouped_allreduce([tensor(x, dtype), tensor(x[:2], dtype)], op=op)
            check(f"grouped_allreduce {op} [0]", outs[0], want, dtype)
            check(f"grouped_allreduce {op} [1]", outs[1], want[:2], dtype)
            rows = [len(a) for a in np.array_split(np.arange(4), N)]
            start = sum(rows[:R])
            check(f"reducescatter {op}", hvd.reducescatter(tensor(x, dtype), op=op),
                  want[start:start + rows[R]], dtype)
            if dtype in ("int32", "float32") or op == hvd.Sum:
                g = in_graph(tensor(x, dtype), op)
                graph_ops[dtype] = True
                check(f"tf.function allreduce {op}", g[0], want, dtype)
                check("tf.function allgather", g[1],
                      np.concatenate([data(r) for r in range(N)]), dtype)
                check("tf.function broadcast", g[2], data(N - 1), dtype)
        check("allreduce default op", hvd.allreduce(tensor(x, dtype)),
              reduce(hvd.Average, dtype), dtype)
        mine = data(R, rows=R + 1)
        check("allgather", hvd.allgather(tensor(mine, dtype)),
              np.concatenate([data(r, rows=r + 1) for r in range(N)]), dtype)
        check("broadcast", hvd.broadcast(tensor(x, dtype), N - 1), data(N - 1), dtype)
        v = tensor(x, dtype, variable=True)
        hvd.broadcast_variables([v], root_rank=N - 1)
        check("broadcast_variables", v, data(N - 1), dtype)
        a = data(R, rows=2 * N)
        check("alltoall", hvd.alltoall(tensor(a, dtype)),
              np.concatenate([data(r, rows=2 * N)[2 * R:2 * R + 2] for r in range(N)]), dtype)
        splits = [j + 1 for j in range(N)]
        a = data(R, rows=sum(splits))
        offs = np.cumsum([0] + splits)
        out, received = hvd.alltoall(tensor(a, dtype), splits=splits)
        check("alltoall splits", out, np.concatenate(
            [data(r, rows=sum(splits))[offs[R]:offs[R + 1]] for r in range(N)]), dtype)
        check("alltoall received", received, np.full(N, R + 1.0), "int32")


def semantics() -> dict:
    out: dict = {}
    try:
        hvd.allreduce(tf.zeros(3 + (R == N - 1 and N > 1)), name="grads.w")
        out["mismatch"] = None
    except hvd.HorovodMismatchError as e:
        out["mismatch"] = str(e)
        out["mismatch_is_tf_error"] = isinstance(e, tf.errors.FailedPreconditionError)
    out["objects"] = [hvd.broadcast_object(("root", R), root_rank=N - 1),
                      hvd.allgather_object(R * 10)]
    return out


# ----------------------------------------------------------------------------- training
STEPS, BATCH, EPOCHS = 6, 12, 2


def batches():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((STEPS * BATCH, 6)).astype(np.float32)
    y = rng.integers(0, 3, STEPS * BATCH)
    return x, y


def mine(a: np.ndarray) -> np.ndarray:
    """This rank's B/N rows of every batch of B, in order."""
    per = BATCH // N
    return np.concatenate([a[s * BATCH + R * per:s * BATCH + (R + 1) * per] for s in range(STEPS)])


def tape_model(sync: bool, seed: int):
    keras.utils.set_random_seed(seed)
    norm = hvd.SyncBatchNormalization if sync else keras.layers.BatchNormalization
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), norm(),
                             keras.layers.Activation("tanh"), keras.layers.Dense(3)])


def train_tape(distributed: bool) -> list[np.ndarray]:
    model = tape_model(distributed, 5 + (R if distributed else 0))
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    if distributed:
        hvd.broadcast_variables(model.variables, root_rank=0)
    x, y = batches()
    per = BATCH // N if distributed else BATCH
    if distributed:
        x, y = mine(x), mine(y)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for s in range(STEPS):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[s * per:(s + 1) * per], model(x[s * per:(s + 1) * per], training=True))
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return [v.numpy() for v in model.variables]


def train_fit(distributed: bool) -> tuple[list[np.ndarray], dict]:
    keras.utils.set_random_seed(11 + (R if distributed else 0))
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    callbacks = []
    if distributed:
        opt = hvdk.DistributedOptimizer(opt)
        callbacks = [hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvdk.callbacks.MetricAverageCallback()]
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = batches()
    if distributed:
        x, y = mine(x), mine(y)
    hist = model.fit(x, y, batch_size=BATCH // N if distributed else BATCH, epochs=EPOCHS,
                     shuffle=False, verbose=0, callbacks=callbacks)
    return [v.numpy() for v in model.variables], hist.history


def warmup() -> list[float]:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.4, momentum=0.5)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = batches()
    hist = model.fit(mine(x), mine(y), batch_size=BATCH // N, epochs=3, shuffle=False, verbose=0,
                     callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                                hvdk.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2)])
    return [float(v) for v in hist.history["lr"]]


# ----------------------------------------------------------------------------- elastic
def elastic() -> dict:
    """hvd.elastic's states and run within one attempt (no restarts: nothing on disk)."""
    out: dict = {"modules": [hvd.elastic.run is hvdk.elastic.run,
                             issubclass(hvdk.elastic.KerasState, hvd.elastic.TensorFlowKerasState),
                             hvd.elastic.ObjectState is hvdk.elastic.ObjectState]}
    # TensorFlowState: rank-dependent values until run's sync makes them rank 0's.
    v = tf.Variable(np.arange(3.0) + R)
    state = hvd.elastic.TensorFlowState([v], step=R)
    resets, calls = [], []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state):
        calls.append((v.numpy().tolist(), state.step))
        if len(calls) == 1:
            v.assign_add(np.ones(3))
            state.step = 5
            state.commit()
            v.assign_add(np.ones(3))  # undone by the reset below
            state.step = 6
            raise tf.errors.UnknownError(None, None, "HorovodInternalError: a peer went away")
        return v.numpy().tolist()

    out["variables"] = [train(state), calls, resets]

    @hvd.elastic.run
    def fails(state):
        raise tf.errors.UnknownError(None, None, "not a collective's")

    try:
        fails(state)
        out["other_error"] = None
    except tf.errors.UnknownError as e:
        out["other_error"] = e.message
    # KerasState: rank 0's model and optimizer; Horovod's callbacks' commits and counters.
    keras.utils.set_random_seed(20 + R)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.Adam(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    kstate = hvdk.elastic.KerasState(model, epoch=0, batch=0)
    commits: list = []
    commit = kstate.commit
    kstate.commit = lambda: (commits.append([kstate.epoch, kstate.batch]), commit())
    x, y = batches()

    @hvdk.elastic.run
    def fit(kstate):
        kstate.model.fit(mine(x)[:3 * 2], mine(y)[:3 * 2], batch_size=2, epochs=2 - kstate.epoch, shuffle=False,
                         verbose=0, callbacks=[hvdk.elastic.UpdateEpochStateCallback(kstate),
                                               hvdk.elastic.UpdateBatchStateCallback(kstate),
                                               hvdk.elastic.CommitStateCallback(kstate, batches_per_commit=2)])

    fit(kstate)
    trained = [w.numpy() for w in model.variables] + [w.numpy() for w in model.optimizer.variables]
    for w in model.variables + model.optimizer.variables:
        w.assign(tf.zeros_like(w))
    kstate.restore()
    after = [w.numpy() for w in model.variables] + [w.numpy() for w in model.optimizer.variables]
    out["keras"] = {"commits": commits, "epoch": kstate.epoch, "batch": kstate.batch,
                    "restored": len(trained) > 4 and all(np.array_equal(a, b) for a, b in zip(trained, after)),
                    "weights": float(sum(np.sum(w) for w in trained))}
    return out


def main() -> None:
    out_dir = sys.argv[1]
    collectives()
    result = semantics()
    ref_tape, dist_tape = train_tape(False), train_tape(True)
    (ref_fit, ref_hist), (dist_fit, dist_hist) = train_fit(False), train_fit(True)
    arrays = {}
    for tag, vs in [("ref_tape", ref_tape), ("dist_tape", dist_tape), ("ref_fit", ref_fit),
                    ("dist_fit", dist_fit)]:
        arrays.update({f"{tag}.{i}": v for i, v in enumerate(vs)})
    np.savez(f"{out_dir}/rank.{R}.npz", **arrays)
    hvdk.broadcast_global_variables(0)  # every live model and optimizer: no error, same values
    result["elastic"] = elastic()
    result.update(rank=R, size=N, checked=checked, failures=failures[:20],
                  loss_ref=ref_hist["loss"], loss_dist=dist_hist["loss"], lr=warmup())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
