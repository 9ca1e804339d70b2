"""collectives.horovod._adasum: Horovod's CPU Adasum, against a pure-NumPy reference of
Horovod's tree (``reference_adasum``), on real ranks under dtrun (1, 2 and 4 ranks; 3 ranks for
the power-of-two error). tests/horovod_adasum_cases.py is the rank program. The vector-halving
exchange is also run on 8 ranks simulated by threads, which this machine cannot run as
processes."""

from __future__ import annotations

import math
import queue
import sys
import threading

import numpy as np
import pytest

from tests.dtrun_helpers import REPO
from tests.horovod_common import results, run_on_localhost

CASES = str(REPO / "tests" / "horovod_adasum_cases.py")
_SQRT_DBL_MIN = math.sqrt(sys.float_info.min)


def _pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Horovod's Adasum of two vectors, in float64 (with its zero-norm guard)."""
    dot, aa, bb = float(a.ravel() @ b.ravel()), float(a.ravel() @ a.ravel()), float(b.ravel() @ b.ravel())
    ca = 1.0 - dot / aa * 0.5 if aa >= _SQRT_DBL_MIN else 1.0
    cb = 1.0 - dot / bb * 0.5 if bb >= _SQRT_DBL_MIN else 1.0
    return ca * a + cb * b


def reference_adasum(arrays: list[np.ndarray], dtype=None) -> np.ndarray:
    """The Adasum of one array per rank (a power-of-two number of them), in Horovod's tree
    order: ranks (0,1), (2,3), ... first, then pairs of those results. With ``dtype``, each
    level's result is rounded to it, as the ranks store it. Returns float64."""
    assert arrays and not len(arrays) & (len(arrays) - 1), "a power-of-two number of arrays"
    level = [np.asarray(a, dtype=np.float64) for a in arrays]
    while len(level) > 1:
        level = [_pair(a, b) for a, b in zip(level[0::2], level[1::2])]
        if dtype is not None:
            level = [x.astype(dtype).astype(np.float64) for x in level]
    return level[0]


# ----------------------------------------------------------------------------- the reference
def test_reference_is_horovods_tree():
    """Orthogonal vectors add up, parallel ones average (Horovod's Adasum guide), and four
    inputs combine as ((0,1),(2,3)), not in another order."""
    e = np.eye(4)
    np.testing.assert_allclose(reference_adasum(list(e)), np.ones(4))
    a = np.array([1.0, 2.0, -1.0])
    np.testing.assert_allclose(reference_adasum([a, 3 * a]), 2 * a)
    xs = [np.array(v, dtype=float) for v in ([1, 0], [1, 1], [0, 2], [3, -1])]
    want = _pair(_pair(xs[0], xs[1]), _pair(xs[2], xs[3]))
    assert np.array_equal(reference_adasum(xs), want)
    assert not np.allclose(want, _pair(_pair(xs[0], xs[2]), _pair(xs[1], xs[3])))
    np.testing.assert_allclose(reference_adasum([np.zeros(2), xs[1]]), xs[1])


def test_size_check_names_the_sizes_that_work():
    from dtrun.collectives.horovod._adasum import AdasumSizeError, check_size

    for size in (1, 2, 4, 8, 64):
        check_size(0, size)
    with pytest.raises(AdasumSizeError, match=r"^adasum_allreduce on rank 5: .* this job has 6: "
                       r"run with 4 or 8 ranks, or reduce with op=Average$") as err:
        check_size(5, 6)
    assert isinstance(err.value, ValueError) and isinstance(err.value, NotImplementedError)


# ----------------------------------------------------------------------------- threads as ranks
class _ThreadComm:
    """The part of collectives.Comm that _adasum uses, for ranks that are threads."""

    def __init__(self, rank: int, size: int, boxes: dict, gate: threading.Barrier):
        self.rank, self.size, self._boxes, self._gate = rank, size, boxes, gate

    def sendrecv(self, x, dest, out, source, sendtag=0, recvtag=0):
        self._boxes[(self.rank, dest)].put(np.array(x))
        got = self._boxes[(source, self.rank)].get(timeout=30)
        assert got.shape == out.shape and got.dtype == out.dtype, (got.shape, out.shape)
        out[...] = got
        return out

    def allgather(self, x):
        self._boxes["all"][self.rank] = np.array(x)
        self._gate.wait(timeout=30)
        every = np.concatenate(self._boxes["all"])
        self._gate.wait(timeout=30)
        return every


def _run_threads(size: int, work) -> list:
    boxes = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
    boxes["all"] = [None] * size
    gate, out = threading.Barrier(size), [None] * size

    def one(r):
        try:
            out[r] = work(_ThreadComm(r, size, boxes, gate))
        except BaseException as e:  # noqa: BLE001 (reported below)
            out[r] = e
            gate.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 8, 37])
def test_vector_halving_matches_reference_on_thread_ranks(size, n):
    from dtrun.collectives.horovod._adasum import adasum_allreduce_many

    rng = np.random.default_rng(size * 100 + n)
    inputs = [[rng.standard_normal(n), rng.standard_normal((2, n))] for _ in range(size)]
    got = _run_threads(size, lambda c: adasum_allreduce_many(c, inputs[c.rank]))
    for r, res in enumerate(got):
        assert not isinstance(res, BaseException), res
        for i in range(2):
            want = reference_adasum([inputs[k][i] for k in range(size)])
            np.testing.assert_allclose(res[i], want, rtol=1e-12, atol=1e-12, err_msg=f"rank {r}")
            assert res[i].tobytes() == got[0][i].tobytes()


# ----------------------------------------------------------------------------- real ranks
@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 4])
def test_adasum_on_ranks(n, tmp_path):
    found = results(run_on_localhost(CASES, n, tmp_path, timeout=240), n)
    for res in found:
        assert res["size"] == n
        assert res["failures"] == [], res["failures"]
        assert res["checked"] > 70
        if n == 1:
            continue
        errs = res["errors"]
        kind, text, is_value, is_type = errs["int32"]
        assert kind == "UnsupportedDtypeError" and is_type, errs["int32"]
        assert "float16, float32 or float64" in text and "\n" not in text
        for case in ("length", "dtype"):
            kind, text, is_value, _ = errs[case]
            assert kind == "MismatchError" and is_value, errs[case]
            assert text.startswith(f"adasum_allreduce on rank {res['rank']}: rank {n - 1} passed")
            assert "rank 0" in text
        assert "5 elements" in errs["length"][1] and "float64" in errs["dtype"][1]


@pytest.mark.mpi
def test_adasum_refuses_three_ranks_on_every_rank(tmp_path):
    found = results(run_on_localhost(CASES, 3, tmp_path, timeout=240), 3)
    for res in found:
        text, is_value, is_not_implemented = res["size_error"]
        assert is_value and is_not_implemented
        assert text.startswith(f"adasum_allreduce on rank {res['rank']}: Adasum needs a "
                               "power-of-two number of ranks")
        assert "has 3" in text and "2 or 4 ranks" in text
