"""Rank program for tests/test_horovod_tf_fidelity.py (2 ranks): where the TensorFlow adapter
once differed from Horovod 0.28.1's ``horovod.tensorflow``, each rank checks it against NumPy.

* graph_names: in a ``tf.compat.v1`` session, independent collectives run in a different
  order on each rank (forced here); each still meets its own partner, run after run (once
  they were named in run order and silently exchanged values); ``tf.function`` too;
* gradients: allgather and broadcast average the upstream gradient over ranks (once
  summed, or crashed), alltoall, reducescatter and the grouped forms have Horovod's, eager,
  in ``tf.function`` and with ``tf.gradients`` in a graph;
* scaling: float16 prescale/postscale in float32, rounded once;
* grouped and sparse: grouped_allgather, grouped_reducescatter, ``tf.IndexedSlices``
  gathered (with and without dense_shape);
* process sets, a second ``init()``; errors of Horovod's types on every rank, in eager
  mode and in graphs; variables broadcast in a graph by the op it returns.

Each rank prints one line ``RESULT {json}`` (``failures`` empty when all is well).
Usage: python tests/horovod_tf_fidelity_cases.py
"""

from __future__ import annotations

import json
import os
import threading
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dtrun.collectives.horovod.tensorflow as hvd  # noqa: E402
from horovod_common import compared  # noqa: E402 (this script's folder)
from horovod_common import raises as _raises  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()

failures: list[str] = []
ran: list[str] = []
WAIT_S = 30.0  # the longest a forced ordering waits for the other collective's input


def same(what: str, got, want, atol: float = 0.0) -> None:
    compared(failures, what, np.asarray(got.numpy() if hasattr(got, "numpy") else got,
                                        dtype=np.float64), want, atol)


def raises(what: str, kinds, call, *needles) -> None:
    """``call()`` must raise one of ``kinds`` whose message holds every needle."""
    _raises(failures, what, kinds, call, *needles)


def vals(r: int, rows: int, cols: int = 3, scale: float = 1.0) -> np.ndarray:
    """Rank r's values: small integers (exact in every dtype used here)."""
    return ((np.arange(rows * cols) + 7 * r) % 5 + 1 + 10 * r).reshape(rows, cols) * scale


# ----------------------------------------------------------------------------- graph names
def _ordered_input(value: np.ndarray, wait: threading.Event | None,
                   release: threading.Event | None) -> tf.Tensor:
    """``value`` as a graph tensor computed only after ``wait`` is set (then it sets
    ``release``): this forces the order in which a rank's collectives start."""
    def body(t):
        if wait is not None and not wait.wait(WAIT_S):
            raise RuntimeError("the other collective's input never ran")
        if release is not None:
            release.set()
        return t
    return tf.py_function(body, [tf.constant(value, tf.float32)], tf.float32)


def graph_names() -> None:
    """Two independent allreduces, started x-first on rank 0 and y-first on the others,
    in 25 runs of one session; then eight independent ones at once."""
    first = threading.Event()
    g = tf.Graph()
    with g.as_default():
        x_in = _ordered_input(vals(R, 2), None if R == 0 else first, first if R == 0 else None)
        y_in = _ordered_input(vals(R, 2, scale=100.0), first if R == 0 else None,
                              None if R == 0 else first)
        x, y = hvd.allreduce(x_in, op=hvd.Sum), hvd.allreduce(y_in, op=hvd.Sum)
        many = [hvd.allreduce(tf.constant(vals(R, 2, scale=k), tf.float32), op=hvd.Sum)
                for k in range(1, 9)]
        with tf.compat.v1.Session(graph=g) as sess:
            for i in range(25):
                first.clear()
                gx, gy = sess.run([x, y])
                same(f"session run {i} x", gx, sum(vals(r, 2) for r in range(N)))
                same(f"session run {i} y", gy, sum(vals(r, 2, scale=100.0) for r in range(N)))
            for i in range(3):
                for k, got in enumerate(sess.run(many), start=1):
                    same(f"session run {i} allreduce {k}", got,
                         sum(vals(r, 2, scale=k) for r in range(N)))

    @tf.function
    def step(a, b):
        return hvd.allreduce(a, op=hvd.Sum), hvd.allgather(b)
    for i in range(3):
        s, gathered = step(tf.constant(vals(R, 2)), tf.constant(vals(R, R + 1)))
        same(f"tf.function call {i} allreduce", s, sum(vals(r, 2) for r in range(N)))
        same(f"tf.function call {i} allgather", gathered,
             np.concatenate([vals(r, r + 1) for r in range(N)]))


# ----------------------------------------------------------------------------- gradients
def _tape(fn, x: np.ndarray, w: np.ndarray):
    v = tf.Variable(x)
    with tf.GradientTape() as tape:
        out = fn(v)
    return tape.gradient(out, v, tf.constant(w))


def gradients_eager() -> None:
    """Each gradient against NumPy, with upstream gradients that differ per rank."""
    ws = [vals(r, 1 + 2, scale=0.5) for r in range(N)]  # allgather: 1 + 2 rows for 2 ranks
    rows = [r + 1 for r in range(N)]
    gathered_w = [vals(r, sum(rows), scale=0.25 + r) for r in range(N)]
    mean_w = sum(gathered_w) / N
    start = sum(rows[:R])
    same("allgather grad", _tape(hvd.allgather, vals(R, rows[R]), gathered_w[R]),
         mean_w[start:start + rows[R]])
    mean_b = sum(vals(r, 2, scale=r + 1.0) for r in range(N)) / N
    same("broadcast grad", _tape(lambda v: hvd.broadcast(v, N - 1), vals(R, 2),
                                 vals(R, 2, scale=R + 1.0)), mean_b if R == N - 1 else 0 * mean_b)
    same("allreduce average grad postscale", _tape(
        lambda v: hvd.allreduce(v, op=hvd.Average, postscale_factor=3.0), vals(R, 2), ws[R][:2]),
        sum(w[:2] for w in ws) / N * 3.0)
    same("reducescatter sum grad", _tape(lambda v: hvd.reducescatter(v, op=hvd.Sum),
                                         vals(R, 2 * N), vals(R, 2, scale=2.0)),
         np.concatenate([vals(r, 2, scale=2.0) for r in range(N)]) * N)
    same("reducescatter average grad", _tape(lambda v: hvd.reducescatter(v, op=hvd.Average),
                                             vals(R, 2 * N), vals(R, 2, scale=2.0)),
         np.concatenate([vals(r, 2, scale=2.0) for r in range(N)]))
    _alltoall_grad()
    _grouped_grads()


def _alltoall_grad() -> None:
    splits = [[r + j + 1 for j in range(N)] for r in range(N)]  # rank r sends splits[r][j] to j
    got_rows = [sum(splits[i][j] for i in range(N)) for j in range(N)]
    w = [vals(j, got_rows[j], scale=j + 1.0) for j in range(N)]
    want = np.concatenate([w[j][sum(splits[i][j] for i in range(R)):][:splits[R][j]]
                           for j in range(N)])
    same("alltoall grad", _tape(lambda v: hvd.alltoall(v, splits=splits[R])[0],
                                vals(R, sum(splits[R])), w[R]), want)


def _grouped_grads() -> None:
    xs = [tf.Variable(vals(R, 2)), tf.Variable(vals(R, R + 1, scale=2.0))]
    with tf.GradientTape(persistent=True) as tape:
        summed = hvd.grouped_allreduce([xs[0], xs[0] * 3], op=hvd.Sum)
        gathered = hvd.grouped_allgather(xs)
        scattered = hvd.grouped_reducescatter([xs[0], xs[0] * 2], op=hvd.Sum)
    same("grouped_allreduce grad", tape.gradient(summed[0], xs[0], tf.constant(vals(R, 2))),
         sum(vals(r, 2) for r in range(N)))
    rows = [r + 1 for r in range(N)]
    w = [vals(r, sum(rows), scale=r + 1.0) for r in range(N)]
    same("grouped_allgather grad", tape.gradient(gathered[1], xs[1], tf.constant(w[R])),
         (sum(w) / N)[sum(rows[:R]):sum(rows[:R + 1])])
    got = tape.gradient(scattered[1], xs[0], tf.ones([1, 3], tf.float64))
    same("grouped_reducescatter grad", got, np.ones((2, 3)) * N * 2)


def gradients_in_graphs() -> None:
    """allgather and broadcast gradients in a tf.compat.v1 graph and in tf.function."""
    rows = [r + 1 for r in range(N)]
    w = [vals(r, sum(rows), scale=r + 1.0) for r in range(N)]
    want = (sum(w) / N)[sum(rows[:R]):sum(rows[:R + 1])]
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(vals(R, rows[R]))
        grad_g = tf.gradients(hvd.allgather(x), x, tf.constant(w[R]))[0]
        x2 = tf.constant(vals(R, 2))
        grad_b = tf.gradients(hvd.broadcast(x2, 0), x2, tf.constant(vals(R, 2, scale=3.0)))[0]
        with tf.compat.v1.Session(graph=g) as sess:
            got_g, got_b = sess.run([grad_g, grad_b])
    same("graph allgather grad", got_g, want)
    same("graph broadcast grad", got_b, sum(vals(r, 2, scale=3.0) for r in range(N)) / N
         if R == 0 else np.zeros((2, 3)))

    @tf.function
    def fn_grad(v, up):
        with tf.GradientTape() as tape:
            tape.watch(v)
            out = hvd.allgather(v)
        return tape.gradient(out, v, up)
    same("tf.function allgather grad", fn_grad(tf.constant(vals(R, rows[R])),
                                               tf.constant(w[R])), want)


# ----------------------------------------------------------------------------- scaling
def _f16(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float16)


def _scaled16(a: np.ndarray, f: float) -> np.ndarray:
    """Horovod's CPU scaling of float16: in float32, rounded once."""
    return _f16(a.astype(np.float32) * np.float32(f))


def scaling() -> None:
    f = 0.1234
    xs = [_f16(vals(r, 4, scale=0.37)) for r in range(N)]
    x = tf.constant(xs[R])
    total = _f16(sum(_scaled16(a, f).astype(np.float64) for a in xs))
    same("float16 prescale", hvd.allreduce(x, op=hvd.Sum, prescale_factor=f), total)
    summed = _f16(sum(a.astype(np.float64) for a in xs))
    same("float16 postscale", hvd.allreduce(x, op=hvd.Sum, postscale_factor=f),
         _scaled16(summed, f))
    same("float16 average postscale", hvd.allreduce(x, op=hvd.Average, postscale_factor=f),
         _scaled16(summed, f / N))
    rows = 4 // N
    mine = slice(R * rows, (R + 1) * rows)
    same("float16 reducescatter prescale",
         hvd.reducescatter(x, op=hvd.Sum, prescale_factor=f), total[mine])
    got = hvd.grouped_reducescatter([x, x], op=hvd.Sum, postscale_factor=f)
    same("float16 grouped_reducescatter postscale", got[1], _scaled16(summed, f)[mine])
    ints = [vals(r, 2).astype(np.int32) for r in range(N)]
    same("int32 prescale truncates", hvd.allreduce(tf.constant(ints[R]), op=hvd.Sum,
                                                   prescale_factor=0.6),
         sum(np.trunc(a * 0.6) for a in ints))


# ----------------------------------------------------------------------------- grouped, sparse
def grouped_and_sparse() -> None:
    parts = [tf.constant(vals(R, R + 1)), tf.constant(vals(R, 2 * R + 1, cols=2))]
    got = hvd.grouped_allgather(parts)
    same("grouped_allgather 0", got[0], np.concatenate([vals(r, r + 1) for r in range(N)]))
    same("grouped_allgather 1", got[1],
         np.concatenate([vals(r, 2 * r + 1, cols=2) for r in range(N)]))
    got = hvd.grouped_reducescatter([tf.constant(vals(R, 2 * N)), tf.constant(vals(R, N))],
                                    op=hvd.Average)
    same("grouped_reducescatter 0", got[0],
         (sum(vals(r, 2 * N) for r in range(N)) / N)[2 * R:2 * R + 2])
    same("grouped_reducescatter 1", got[1], (sum(vals(r, N) for r in range(N)) / N)[R:R + 1])
    for shape in ([10, 3], None):
        sl = tf.IndexedSlices(tf.constant(vals(R, 2)), tf.constant([R, R + 3]),
                              None if shape is None else tf.constant(shape))
        for op, div in ((hvd.Sum, 1), (hvd.Average, N)):
            out = hvd.allreduce(sl, op=op)
            same(f"sparse {op} values (dense_shape {shape})", out.values,
                 np.concatenate([vals(r, 2) for r in range(N)]) / div)
            same(f"sparse {op} indices", out.indices,
                 np.concatenate([[r, r + 3] for r in range(N)]))
    mixed = hvd.grouped_allreduce([sl, tf.constant(vals(R, 2))], op=hvd.Sum)
    same("grouped sparse values", mixed[0].values, np.concatenate([vals(r, 2) for r in range(N)]))
    same("grouped dense", mixed[1], sum(vals(r, 2) for r in range(N)))


# ----------------------------------------------------------------------------- process sets
def process_sets() -> None:
    sets = [hvd.add_process_set([r]) for r in range(N)]
    mine, other = sets[R], sets[(R + 1) % N]
    x = tf.constant(vals(R, 2))
    same("allreduce on my set", hvd.allreduce(x, op=hvd.Sum, process_set=mine), vals(R, 2))
    same("allgather on my set", hvd.allgather(x, process_set=mine), vals(R, 2))
    same("broadcast on my set", hvd.broadcast(x, R, process_set=mine), vals(R, 2))
    same("global set", hvd.allreduce(x, op=hvd.Sum, process_set=hvd.global_process_set),
         sum(vals(r, 2) for r in range(N)))
    same("size_op of my set", hvd.size_op(process_set_id=mine.process_set_id), 1)
    if N > 1:  # Horovod answers for a set this rank is not in too
        same("size_op of the other set", hvd.size_op(process_set_id=other.process_set_id), 1)
    same("included in mine", hvd.process_set_included_op(mine.process_set_id), 1)
    same("included in the other", hvd.process_set_included_op(other.process_set_id), 0)
    for kind in (ValueError, tf.errors.InvalidArgumentError):
        raises(f"allreduce on a set without this rank is {kind.__name__}", kind,
               lambda: hvd.allreduce(x, process_set=other), f"rank {R} is not in")
    hvd.init()  # a second init on every rank returns at once
    if R == 0:
        hvd.init()  # and on one rank alone too
    for ps in sets:
        if not hvd.remove_process_set(ps):
            failures.append(f"remove_process_set({ps.ranks}) returned False")
    raises("allreduce on a removed set", ValueError, lambda: hvd.allreduce(x, process_set=mine),
           "not registered")



# ----------------------------------------------------------------------------- errors
def _in_session(build):
    g = tf.Graph()
    with g.as_default():
        out = build()
        with tf.compat.v1.Session(graph=g) as sess:
            return sess.run(out)


def errors() -> None:
    """Horovod's error types, eager and in graphs; the messages name both ranks."""
    precondition = (tf.errors.FailedPreconditionError, hvd.HorovodMismatchError)
    ones = tf.ones([3 + (R == N - 1)])
    where = f"has shape (4,) on rank {N - 1} but (3,) on rank 0"
    for kind in precondition:
        raises(f"eager shape mismatch is {kind.__name__}", kind,
               lambda: hvd.allreduce(ones), where)
    raises("graph shape mismatch", tf.errors.FailedPreconditionError,
           lambda: _in_session(lambda: hvd.allreduce(tf.ones([3 + (R == N - 1)]))), where)
    raises("tf.function shape mismatch", tf.errors.FailedPreconditionError,
           lambda: tf.function(lambda: hvd.allgather(tf.ones([2, 2 + R])))(),
           "only the first dimension may differ")
    raises("dtype mismatch", tf.errors.FailedPreconditionError,
           lambda: hvd.allgather(tf.ones([2], tf.int32 if R == 0 else tf.float32)),
           "int32", "float32")
    raises("root mismatch", tf.errors.FailedPreconditionError,
           lambda: hvd.broadcast(tf.ones([2]), R), "root_rank")
    for mode, run in (("eager", lambda f: f()), ("graph", lambda f: _in_session(f))):
        raises(f"{mode} alltoall splits", tf.errors.InvalidArgumentError,
               lambda: run(lambda: hvd.alltoall(tf.ones([N + 1]), splits=[1] * N)), "splits")
        raises(f"{mode} alltoall uneven", tf.errors.InvalidArgumentError,
               lambda: run(lambda: hvd.alltoall(tf.ones([N + 1]))), "does not split evenly")
        raises(f"{mode} reducescatter scalar", tf.errors.InvalidArgumentError,
               lambda: run(lambda: hvd.reducescatter(tf.constant(1.0))), "scalar")
    sparse = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([R]))
    raises("sparse Min", NotImplementedError, lambda: hvd.allreduce(sparse, op=hvd.Min))
    raises("sparse prescale", NotImplementedError,
           lambda: hvd.allreduce(sparse, op=hvd.Sum, prescale_factor=2.0))
    raises("broadcast_global_variables eagerly", RuntimeError,
           lambda: hvd.broadcast_global_variables(0), "eager")
    same("after the errors, a collective still pairs",
         hvd.allreduce(tf.constant([1.0 + R]), op=hvd.Sum), [sum(1.0 + r for r in range(N))])


# ----------------------------------------------------------------------------- variables
def variables() -> None:
    """In a graph, broadcast_variables and broadcast_global_variables return the op that
    assigns root's values; broadcast_ returns the values after its assignment."""
    g = tf.Graph()
    with g.as_default():
        a = tf.compat.v1.Variable(vals(R, 2), name="a")
        b = tf.compat.v1.Variable(np.int32(R + 5), name="b")
        c = tf.compat.v1.Variable(vals(R, 1, scale=2.0), name="c")
        op = hvd.broadcast_variables([a, b], root_rank=N - 1)
        everything = hvd.broadcast_global_variables(0)
        (after,) = hvd.broadcast_([c], root_rank=N - 1)
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            if not isinstance(op, tf.Operation):
                failures.append(f"graph broadcast_variables returned {op!r}, not an op")
            sess.run(op)
            same("broadcast_variables a", sess.run(a), vals(N - 1, 2))
            same("broadcast_variables b", sess.run(b), N - 1 + 5)
            same("broadcast_ value", sess.run(after), vals(N - 1, 1, scale=2.0))
            same("broadcast_ variable", sess.run(c), vals(N - 1, 1, scale=2.0))
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(everything)
            same("broadcast_global_variables", sess.run([a, b, c])[0], vals(0, 2))
    same("size_op", hvd.size_op(), N)
    same("rank_op", hvd.rank_op(), R)
    same("local_size_op", hvd.local_size_op(), hvd.local_size())
    if R == N - 1:  # the others have joined, or will: they add zeros
        same("allreduce with joined ranks", hvd.allreduce(tf.constant([5.0]), op=hvd.Sum), [5.0])
    same("join returns the last rank to join", hvd.join(), N - 1)


def main() -> None:
    for section in (graph_names, gradients_eager, gradients_in_graphs, scaling,
                    grouped_and_sparse, process_sets, errors, variables):
        try:
            section()
        except Exception as e:  # noqa: BLE001 — reported, and the other sections still run
            failures.append(f"{section.__name__}: {type(e).__name__}: {e} "
                            f"{traceback.format_exc()[-800:]}")
        ran.append(section.__name__)
    print("RESULT " + json.dumps({"rank": R, "size": N, "ran": ran, "failures": failures}),
          flush=True)


if __name__ == "__main__":
    main()
