"""dtrun.collectives.horovod.tensorflow and .keras: Horovod's TensorFlow 2 and Keras 3 API on real
ranks under dtrun (1, 2, 3 ranks, and 2 namespace hosts x 2 ranks). tests/horovod_tf_cases.py
is the rank program (one launch per size: TensorFlow starts slowly): the collectives on
tensors and variables, eager and in tf.function, against NumPy; DistributedGradientTape with
SyncBatchNormalization, and Keras fit with DistributedOptimizer and the callbacks, equal to
one process on the whole batch; the warm-up's learning rates; the errors; hvd.elastic within
one attempt (tests/test_elastic_tf.py restarts)."""

from __future__ import annotations


import numpy as np
import pytest

from tests.dtrun_helpers import REPO
from tests.horovod_common import (assert_trained_alike, driver_tests, example_line, load_ranks,
                                   mismatch)

CASES = str(REPO / "tests" / "horovod_tf_cases.py")


def _check(found: list[dict], out, n: int) -> None:
    for res in found:
        assert res["size"] == n
        assert res["failures"] == [], res["failures"]
        assert res["checked"] > 300
        assert res["objects"] == [["root", n - 1], [10 * r for r in range(n)]]
        _check_elastic(res["elastic"], n)
        if n > 1:
            assert res["mismatch"] == mismatch(res["rank"], n)
            assert res["mismatch_is_tf_error"]
        # MetricAverageCallback: the ranks' averaged epoch losses are the whole batch's
        np.testing.assert_allclose(res["loss_dist"], res["loss_ref"], rtol=1e-5)
        # LearningRateWarmupCallback: lr/N * ((epoch + 1) * (N - 1) / 2 + 1), then lr
        np.testing.assert_allclose(res["lr"], [0.4 / n * ((n - 1) / 2 + 1), 0.4, 0.4], rtol=1e-6)
    assert len({res["elastic"]["keras"]["weights"] for res in found}) == 1  # rank 0's, then trained alike
    ranks = load_ranks(out, n)
    for tag in ("tape", "fit"):
        keys = [k[len("dist_"):] for k in ranks[0] if k.startswith(f"dist_{tag}.")]
        assert len(keys) >= 4
        assert_trained_alike(ranks, [(f"dist_{k}", f"ref_{k}") for k in keys])


def _check_elastic(el: dict, n: int) -> None:
    assert el["modules"] == [True, True, True]
    # run synchronised rank 0's values; a HorovodInternalError (as a graph reports it) went back
    # to the commit, reset (the callback saw the size) and ran the function again
    assert el["variables"] == [[1.0, 2.0, 3.0], [[[0.0, 1.0, 2.0], 0], [[1.0, 2.0, 3.0], 5]], [n]]
    assert el["other_error"] == "not a collective's"
    # 2 epochs of 3 batches, a commit every 2 batches and at each epoch's end, with Horovod's
    # (epoch, batch) at each
    assert el["keras"]["commits"] == [[0, 1], [1, 0], [1, 0], [1, 2], [2, 0]]
    assert (el["keras"]["epoch"], el["keras"]["batch"]) == (2, 0)
    assert el["keras"]["restored"]


test_horovod_tensorflow_keras_ranks, test_horovod_tensorflow_keras_two_hosts = driver_tests(
    CASES, _check, 420)


@pytest.mark.mpi
@pytest.mark.parametrize("example", ["horovod_keras_mnist.py", "horovod_tensorflow2_mnist.py"])
def test_horovod_tf_examples_learn(example):
    # Horovod's Keras and TensorFlow 2 MNIST examples with only the import changed, 2 ranks.
    last = example_line(example, "test accuracy ", timeout=420)
    assert float(last.split()[-1].rstrip("%")) > 80
