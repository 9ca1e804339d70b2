"""hvd.elastic for TensorFlow and Keras on dtrun's restarts (``dtrun --horovod --max-restarts``).

An unchanged Horovod elastic script (``SCRIPT``: Keras ``model.fit`` with ``KerasState`` and
Horovod's elastic callbacks, or a TensorFlow 2 loop with ``TensorFlowKerasState``) loses a
rank (it exits) or a host (every process on it killed) in its first attempt; the next attempt
resumes from the last commit, held on the hosts' own disks, and ends with the weights of a run
that never failed. The commit it resumes from is a mid-run one (a run started over would print
no commit, start at epoch 0 and take more steps). In a ``tf.compat.v1`` graph,
``TensorFlowState`` keeps its variables through its session. tests/horovod_tf_cases.py checks
the states and callbacks within one attempt.
"""
from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

from tests.dtrun_helpers import PYTHON, dtrun, module_cluster, user_env
from tests.test_restarts_cluster import lose_at, start

# Rank 1 of the first attempt fails once, right after a commit: at the fit's epoch 1, batch 3
# (commit 10: 6 batch commits and 1 epoch commit in epoch 0, then 3), or at the loop's step 8
# (commit 8). "exit": it dies; "hang": it waits for its host to be lost.
SCRIPT = '''
import os
import sys
import time

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

hvd.init()
N, R = hvd.size(), hvd.rank()
MODES, FAULT = sys.argv[1].split(","), sys.argv[2]
EPOCHS, STEPS, B = 3, 6, 4
FIRST = os.environ.get("DTRUN_RESTART_COUNT", "0") == "0"


def say(*words):
    print(*words, flush=True)


def fault(where):
    if R == 1 and FIRST and FAULT != "none":
        say(f"rank 1 fails at {where}")
        if FAULT == "exit":
            os._exit(9)
        time.sleep(600)


def data():
    """This rank's share of each global batch, the same every epoch."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((STEPS * B * N, 6)).astype(np.float32)
    y = rng.integers(0, 3, STEPS * B * N)
    mine = np.concatenate([np.arange(s * B * N + R * B, s * B * N + (R + 1) * B) for s in range(STEPS)])
    return x[mine], y[mine]


def model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(8, activation="tanh"),
                                tf.keras.layers.Dense(3)])


def weights(m):
    return " ".join(f"{v:.9g}" for w in m.get_weights() for v in np.ravel(w))


def fit():
    m = model()
    m.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.05)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    state = hvd.elastic.KerasState(m, epoch=0, batch=0, done=0)
    x, y = data()

    class Progress(tf.keras.callbacks.Callback):
        """Counts the batches done this epoch: a resumed epoch skips them."""

        def on_train_batch_end(self, batch, logs=None):
            state.done += 1

        def on_epoch_end(self, epoch, logs=None):
            state.done = 0

    class Report(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if R == 0:
                say(f"fit epoch {state.epoch} done {state.done}")
            if state.epoch == 1 and state.done == 3:
                fault("fit epoch 1 batch 3")

    callbacks = [Progress(), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.CommitStateCallback(state), Report()]

    @hvd.elastic.run
    def train(state):
        if R == 0:
            say(f"fit starts at epoch {state.epoch} batch {state.done} on {N} ranks")
        while state.epoch < EPOCHS:
            skip = state.done * B
            state.model.fit(x[skip:], y[skip:], batch_size=B, epochs=1, shuffle=False, verbose=0,
                            callbacks=callbacks)

    train(state)
    if R == 0:
        say("final fit w", weights(m))


def tape():
    m = model()
    opt = tf.keras.optimizers.Adam(0.05)
    state = hvd_tf.elastic.TensorFlowKerasState(m, opt, step=0)
    x, y = data()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as t:
            loss = loss_fn(yb, m(xb, training=True))
        grads = hvd_tf.DistributedGradientTape(t).gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))

    @hvd_tf.elastic.run
    def train(state):
        if R == 0:
            say(f"tape starts at step {state.step} on {N} ranks")
        while state.step < EPOCHS * STEPS:
            s = state.step % STEPS
            step(x[s * B:(s + 1) * B], y[s * B:(s + 1) * B])
            state.step += 1
            state.commit()
            if state.step == 8:
                fault("tape step 8")

    train(state)
    if R == 0:
        say("final tape w", weights(m))


for mode in MODES:
    {"fit": fit, "tape": tape}[mode]()
'''


def _script(tmp_path):
    path = tmp_path / "elastic_tf.py"
    path.write_text(SCRIPT)
    return path


def final_w(stdout: str, mode: str) -> np.ndarray:
    found = re.findall(rf"^final {mode} w (.+)$", stdout, re.M)
    assert len(found) == 1, stdout[-3000:]
    return np.array([float(v) for v in found[0].split()])


def resumed(stderr: str) -> tuple[int, str]:
    """(commit, host) of the one ``dtrun elastic: resumed from commit`` line."""
    found = re.findall(r"^dtrun elastic: resumed from commit (\d+) \(made by \d+ ranks\), held on (\S+); "
                       r"\d+ ranks now$", stderr, re.M)
    assert len(found) == 1, stderr[-3000:]
    return int(found[0][0]), found[0][1]


def _local(tmp_path, np_, modes, fault, *args):
    return dtrun("-np", np_, "--oversubscribe", "--horovod", "--no-tag-output", *args, PYTHON, _script(tmp_path),
                 modes, fault, timeout=240)


@pytest.fixture(scope="module")
def never_failed(tmp_path_factory):
    """The final weights of both programs on 2 ranks that never failed (no restarts: no commits on disk)."""
    p = _local(tmp_path_factory.mktemp("ref"), 2, "fit,tape", "none")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from commit" not in p.stderr
    return {mode: final_w(p.stdout, mode) for mode in ("fit", "tape")}


@pytest.mark.mpi
@pytest.mark.parametrize("mode, commit, start", [
    ("fit", 10, "fit starts at epoch 1 batch 3 on 2 ranks"),
    ("tape", 8, "tape starts at step 8 on 2 ranks"),
])
def test_killed_rank_resumes_from_the_last_commit(never_failed, tmp_path, mode, commit, start):
    p = _local(tmp_path, 2, mode, "exit", "--max-restarts", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dtrun: attempt 2 of 2: rank 1 on " in p.stderr, p.stderr[-3000:]
    assert p.stdout.count("rank 1 fails at ") == 1
    assert resumed(p.stderr)[0] == commit
    assert start in p.stdout, p.stdout[-3000:]
    np.testing.assert_allclose(final_w(p.stdout, mode), never_failed[mode], rtol=1e-6, atol=1e-7)


def test_tensorflow_state_keeps_a_tf1_graphs_variables_through_its_session():
    code = """
import numpy as np, tensorflow as tf
tf.compat.v1.disable_eager_execution()
import dtrun.collectives.horovod.tensorflow as hvd
hvd.init()
v = tf.compat.v1.Variable(np.arange(3.0))
w = tf.compat.v1.Variable(np.ones(2, np.float32))
sess = tf.compat.v1.Session()
sess.run(tf.compat.v1.global_variables_initializer())
with sess.as_default():
    state = hvd.elastic.TensorFlowState(step=0)  # the graph's variables, the default session
add = v.assign_add(np.ones(3))
seen = []

@hvd.elastic.run
def train(state):
    sess.run(add); state.step = 1; state.commit()
    sess.run(add); state.step = 2
    state.restore()
    seen.append([sess.run(v).tolist(), state.step])
    snap = state._snapshot()  # what a commit keeps on disk
    sess.run(add); state.step = 3
    state._load_snapshot(snap); state.restore()
    seen.append([sess.run(v).tolist(), sess.run(w).tolist(), state.step])

train(state)
print("SEEN", seen)
try:
    hvd.elastic.TensorFlowKerasState(None)
except ValueError as e:
    print("KERAS", e)
"""
    p = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120, env=user_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SEEN [[[1.0, 2.0, 3.0], 1], [[1.0, 2.0, 3.0], [1.0, 1.0], 1]]" in p.stdout, p.stdout
    assert ("KERAS TensorFlowKerasState needs eager execution (TensorFlow 2); in a tf.compat.v1 graph use "
            "hvd.elastic.TensorFlowState(variables, session)") in p.stdout, p.stdout


# ---- a host lost: 3 hosts and a spare ------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster4():
    yield from module_cluster(4, terminate_strays=True)


@pytest.mark.cluster
@pytest.mark.mpi
def test_lost_host_resumes_from_a_surviving_hosts_commit(cluster4, tmp_path):
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = _local(ref_dir, 3, "fit", "none")
    assert ref.returncode == 0, ref.stderr[-3000:]
    job = tmp_path / "job"
    job.mkdir()
    a, b, c, d = cluster4.hosts
    p = start(cluster4, "-H", ",".join(f"{h.name}:1" for h in cluster4.hosts), "-np", "3", "--max-restarts", "2",
              "--horovod", PYTHON, _script(job), "fit", "hang")
    rc, out, err = lose_at(cluster4, p, r"^rank 1 fails at fit epoch 1 batch 3", b)
    assert rc == 0, err[-3000:]
    assert re.search(rf"^dtrun: attempt 2 of 3: {b.name} left out .+; 3 ranks on {a.name}, {c.name}, "
                     rf"{d.name} \(spare\)$", err, re.M), err[-3000:]
    commit, host = resumed(err)
    assert commit == 10 and host in (a.name, c.name), err[-3000:]
    assert "fit starts at epoch 1 batch 3 on 3 ranks" in out, out[-3000:]
    np.testing.assert_allclose(final_w(out, "fit"), final_w(ref.stdout, "fit"), rtol=1e-6, atol=1e-7)
    # no checkpoint file, no shared directory: the job's folder holds its script alone
    assert [f.name for f in job.iterdir()] == ["elastic_tf.py"]
