"""Rank program for tests/test_horovod_adasum.py: run under ``dtrun -np N``.

Every rank builds every rank's input from one seed, so each can compute the expected Adasum
with ``reference_adasum`` (pure NumPy, Horovod's tree) and compare it with what
``collectives.horovod._adasum`` returns:

* random vectors of several lengths (shorter than the number of ranks, odd, 2-D) in float16,
  float32 and float64, against the reference rounded to the dtype at each level as the ranks
  store it;
* Horovod's own expectations: orthogonal vectors add up, parallel ones average, tiny and
  widely scaled values stay stable, a zero vector adds nothing;
* several arrays at once equal each one alone (each has its own dot product and norms);
* every rank gets the same bytes, and the input is left as it was;
* errors on every rank, never a hang: an integer dtype, a length or dtype that differs on the
  last rank, and (at 3 ranks) a number of ranks that is not a power of two.

Each rank prints one line ``RESULT {json}``. Usage: python tests/horovod_adasum_cases.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.*

from dtrun import collectives  # noqa: E402
from dtrun.collectives.horovod._adasum import (AdasumSizeError, adasum_allreduce,  # noqa: E402
                                               adasum_allreduce_many)
from tests.test_horovod_adasum import reference_adasum  # noqa: E402

comm = collectives.init()
R, N = comm.rank, comm.size
failures: list[str] = []
checked = 0
# Relative error allowed against the reference rounded at each level as the ranks round: the
# ranks sum their partial dot products in another order, and float16 combines in float32.
REL = {np.float16: 4e-3, np.float32: 1e-6, np.float64: 1e-13}


def close(what: str, got: np.ndarray, want: np.ndarray, dtype, rel=None) -> None:
    global checked
    checked += 1
    got = np.asarray(got, np.float64)
    err = np.linalg.norm((got - want).ravel())
    scale = np.linalg.norm(want.ravel())
    if got.shape != want.shape or not err <= (rel or REL[dtype]) * max(scale, 1e-300):
        failures.append(f"{what} {np.dtype(dtype)}: relative error {err / max(scale, 1e-300):.3g}"
                        f" (got {got.ravel()[:4]}, want {want.ravel()[:4]})")


def same_everywhere(what: str, x: np.ndarray) -> None:
    """Every rank holds exactly these bytes."""
    global checked
    checked += 1
    raw = np.frombuffer(np.ascontiguousarray(x).tobytes(), dtype=np.uint8)
    every = comm.allgather(raw).reshape(N, -1)
    if not (every == every[0]).all():
        failures.append(f"{what}: ranks got different bytes")


def reduce_mine(what: str, inputs: list[np.ndarray], dtype, rel=None) -> None:
    """Adasum of ``inputs[R]`` over the ranks, against the reference."""
    x = inputs[R].astype(dtype)
    before = x.copy()
    got = adasum_allreduce(comm, x)
    want = reference_adasum([a.astype(dtype) for a in inputs], dtype)
    close(what, got, want, dtype, rel)
    same_everywhere(f"{what} {np.dtype(dtype)}", got)
    if got.dtype != np.dtype(dtype) or not np.array_equal(x, before):
        failures.append(f"{what} {np.dtype(dtype)}: dtype {got.dtype} or input changed")


def expect(what: str, inputs: list[np.ndarray], plain: np.ndarray, dtype) -> None:
    """Against the reference, and within Horovod's tests' tolerance (relative error below
    100 epsilons) of ``plain``, the sum or average Horovod's tests expect."""
    reduce_mine(what, inputs, dtype)
    close(f"{what} (Horovod's expectation)", adasum_allreduce(comm, inputs[R].astype(dtype)),
          plain, dtype, rel=100 * np.finfo(dtype).eps)


def random_cases() -> None:
    rng = np.random.default_rng(7)
    for shape in [(1,), (N + 1,), (2 * N + 3,), (N * 20 - 17,), (3, 5), (1000,)]:
        inputs = [rng.standard_normal(shape) for _ in range(N)]
        for dtype in (np.float16, np.float32, np.float64):
            reduce_mine(f"random {shape}", inputs, dtype)


def horovod_expectations() -> None:
    """What Horovod's Adasum tests expect, against plain sums and averages."""
    rng = np.random.default_rng(2)
    for dtype in (np.float16, np.float32, np.float64):
        n = 4 * N + 3
        q, _ = np.linalg.qr(rng.standard_normal((n, N)))  # orthonormal columns: a sum
        cols = [q[:, r].astype(dtype).astype(np.float64) for r in range(N)]
        expect("orthogonal", cols, sum(cols), dtype)
        base, scale = rng.standard_normal(n), rng.standard_normal(N)  # parallel: the average
        cols = [(base * scale[r]).astype(dtype).astype(np.float64) for r in range(N)]
        expect("parallel", cols, sum(cols) / N, dtype)
        zeros = [np.zeros(n) if r == 0 else rng.standard_normal(n) for r in range(N)]
        reduce_mine("a zero vector", zeros, dtype)
        if dtype == np.float64:
            continue  # Horovod checks stability in float16 and float32 (float64 norms overflow)
        tiny = rng.normal(0, np.finfo(dtype).tiny, (64,))
        reduce_mine("tiny values", [tiny * scale[r] for r in range(N)], dtype)
        top, low = np.sqrt(float(np.finfo(dtype).max)), float(np.finfo(dtype).tiny)
        mags = [top ** ((i + 1) / N) * low ** ((N - i - 1) / N) for i in range(N)]
        reduce_mine("wide magnitudes", [base[:64] * m for m in rng.permutation(mags)], dtype)


def many_at_once() -> None:
    rng = np.random.default_rng(11)
    shapes = [(5,), (2, 3), (1,), (0,), (17,)]
    inputs = [[rng.standard_normal(s) for s in shapes] for _ in range(N)]
    for dtype in (np.float32, np.float64):
        mine = [a.astype(dtype) for a in inputs[R]]
        together = adasum_allreduce_many(comm, mine)
        for i, got in enumerate(together):
            want = reference_adasum([inputs[r][i].astype(dtype) for r in range(N)], dtype)
            close(f"many[{i}]", got, want, dtype)
            alone = adasum_allreduce(comm, mine[i])
            close(f"many[{i}] alone", alone, want, dtype)


def errors() -> dict:
    """Each error case's (exception type, message) on this rank; a barrier after each shows
    that no rank was left inside the reduction."""
    seen = {}
    last = R == N - 1
    cases = {
        "int32": lambda: adasum_allreduce(comm, np.ones(4, np.int32)),
        "length": lambda: adasum_allreduce(comm, np.ones(5 if last else 4, np.float32)),
        "dtype": lambda: adasum_allreduce(comm, np.ones(4, np.float64 if last else np.float32)),
    }
    for name, call in cases.items():
        try:
            call()
            seen[name] = None
        except Exception as e:  # noqa: BLE001 (the type is what the test checks)
            seen[name] = [type(e).__name__, str(e), isinstance(e, ValueError),
                          isinstance(e, TypeError)]
        comm.barrier()
    return seen


def main() -> None:
    res = {"rank": R, "size": N}
    if N & (N - 1):
        try:
            adasum_allreduce(comm, np.ones(4, np.float32))
            res["size_error"] = None
        except AdasumSizeError as e:
            res["size_error"] = [str(e), isinstance(e, ValueError),
                                 isinstance(e, NotImplementedError)]
        comm.barrier()
    else:
        random_cases()
        horovod_expectations()
        many_at_once()
        if N > 1:
            res["errors"] = errors()
    res.update(failures=failures, checked=checked)
    print("RESULT " + json.dumps(res), flush=True)


main()
