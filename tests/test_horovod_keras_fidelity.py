"""The TensorFlow/Keras training layer of dtrun.collectives.horovod behaves as Horovod 0.28.1,
on 2 real ranks under dtrun (tests/horovod_keras_fidelity_cases.py is the rank program):

* Keras 2 (tf_keras, ``TF_USE_LEGACY_KERAS=1``): ``DistributedOptimizer`` averages (it
  used to apply each rank's own gradients: the ranks' weights diverged) and the callbacks
  run (they used to crash);
* ``backward_passes_per_step`` and ``PartialDistributedOptimizer`` with Keras 3 and
  tf_keras; ``PartialDistributedGradientTape``, ``register_local_source``,
  ``sparse_as_dense``;
* TensorFlow 1 style: ``DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer)``,
  ``MonitoredTrainingSession`` with ``BroadcastGlobalVariablesHook(0)``.

Each compares every rank's weights with a one-process simulation of all ranks' training.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.dtrun_helpers import REPO, dtrun
from tests.horovod_common import results

CASES = str(REPO / "tests" / "horovod_keras_fidelity_cases.py")
N = 2


def run_case(case: str, out, legacy: bool = False) -> list[dict]:
    env = ["-x", "TF_USE_LEGACY_KERAS=1"] if legacy else []
    proc = dtrun("-np", N, "-H", f"localhost:{N}", "--oversubscribe", *env, sys.executable,
                 CASES, case, out, timeout=420)
    found = results(proc, N)
    for res in found:
        assert res["failures"] == [], res["failures"]
    return found


def shared_alike(out, case: str, skip=()) -> None:
    """Every rank's saved weights are bit-identical, except those named in ``skip``."""
    ranks = [dict(np.load(out / f"{case}.{r}.npz")) for r in range(N)]
    for key in ranks[0]:
        if not any(s in key for s in skip):
            assert ranks[1][key].tobytes() == ranks[0][key].tobytes(), key


@pytest.mark.mpi
@pytest.mark.parametrize("legacy", [False, True], ids=["keras3", "tf_keras"])
def test_keras_fit_averages_aggregates_and_keeps_local_layers(legacy, tmp_path):
    if legacy:
        pytest.importorskip("tf_keras")
    found = run_case("keras", tmp_path, legacy)
    assert found[0]["keras"].startswith("tf_keras") == legacy  # Keras 3: keras._tf_keras
    # the local layer (weights 0 and 1 of the partial runs) differs by rank, the rest not
    shared_alike(tmp_path, "keras", skip=("partial.0", "partial.1"))


@pytest.mark.mpi
def test_partial_tape_local_sources_and_sparse_gradients(tmp_path):
    run_case("tape", tmp_path)


@pytest.mark.mpi
def test_tf1_optimizer_and_broadcast_hook(tmp_path):
    run_case("tf1", tmp_path)
    shared_alike(tmp_path, "tf1")
