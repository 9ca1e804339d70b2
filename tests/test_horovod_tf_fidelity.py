"""dtrun.collectives.horovod.tensorflow behaves as Horovod 0.28.1's horovod.tensorflow where it
once did not: collectives in a tf.compat.v1 graph meet their own partner whatever order the
ranks run them in, gradients, float16 scaling, the grouped and sparse forms, process sets,
errors of Horovod's types in eager mode and in graphs, variables broadcast in a graph.
tests/horovod_tf_fidelity_cases.py is the rank program (2 ranks, every result against
NumPy)."""

from __future__ import annotations

import sys

import pytest

from tests.dtrun_helpers import REPO, dtrun
from tests.horovod_common import results

CASES = str(REPO / "tests" / "horovod_tf_fidelity_cases.py")
ALL = ["graph_names", "gradients_eager", "gradients_in_graphs", "scaling", "grouped_and_sparse",
       "process_sets", "errors", "variables"]


@pytest.mark.mpi
def test_horovod_tensorflow_matches_horovod():
    proc = dtrun("-np", 2, "-H", "localhost:2", "--oversubscribe", sys.executable, CASES,
                 timeout=300)
    for res in results(proc, 2):
        assert res["failures"] == [], res["failures"]
        assert res["ran"] == ALL
