"""dtrun.collectives.horovod.torch behaves as Horovod 0.28.1's horovod.torch where it once
did not: gradients, scaling, grouped and sparse collectives, process sets, a second init,
error types, Adasum and the optimizer's details. tests/horovod_torch_fidelity_cases.py is
the rank program (2 ranks, every result against NumPy)."""

from __future__ import annotations

import sys

import pytest

from tests.dtrun_helpers import REPO, dtrun
from tests.horovod_common import results

CASES = str(REPO / "tests" / "horovod_torch_fidelity_cases.py")
ALL = ["gradients", "scaling", "grouped", "sparse", "process_sets", "errors", "adasum",
       "optimizer_details"]


@pytest.mark.mpi
def test_horovod_torch_matches_horovod():
    proc = dtrun("-np", 2, "-H", "localhost:2", "--oversubscribe", sys.executable, CASES,
                 timeout=240)
    for res in results(proc, 2):
        assert res["failures"] == [], res["failures"]
        assert res["ran"] == ALL
