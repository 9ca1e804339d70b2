"""The path selector's measurement (collectives/tuning.py), on a one-rank communicator with
candidates whose cost is made by the test: what a job sees in a loop (the median round)
decides, set-up in a warm-up round does not cut the calibration short, and a table whose
budget ran out early is not cached. The real paths are timed against raw MPI by
`make bench` (benchmarks/bench_collectives.py), not here."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from dtrun.collectives import tuning  # noqa: E402
from dtrun.collectives._mpi import MPI  # noqa: E402


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Costs:
    """``run`` for tuning.measure: each candidate's cost per call comes from ``cost(name, i)``
    (``i``: the how-manyth call of that candidate)."""

    def __init__(self, cost):
        self.cost, self.calls = cost, {}

    def __call__(self, cand, src, dst, inplace):
        i = self.calls.get(cand[0], 0)
        self.calls[cand[0]] = i + 1
        spin(self.cost(cand[0], i))


def test_the_median_round_decides_not_the_best_one():
    """"shm1" is fast in one timed round of five and slow in the rest; "shm2" is steady in
    between. A job calling it in a loop sees shm1's usual time: shm2 must be chosen (the
    best round would choose shm1)."""
    state = {"rounds": 0, "last": None}

    def run(cand, src, dst, inplace):
        # Candidates alternate within a round, so a round is where shm1 follows another one
        # (round 1 is the warm-up; timed rounds are 2 to 6, and shm1 is fast in round 4).
        if cand[0] == "shm1" and state["last"] != "shm1":
            state["rounds"] += 1
        state["last"] = cand[0]
        if cand[0] == "mpi":
            spin(400e-6)
        elif cand[0] == "shm2":
            spin(200e-6)
        else:
            spin(20e-6 if state["rounds"] == 4 else 350e-6)

    cands = [("mpi", 0), ("shm1", 0), ("shm2", 0)]
    times = tuning.measure(MPI.COMM_SELF, cands, run, first=6, rounds=(5, 5), budget=0.05)
    assert (times[7:, :, 0] == tuning.EXTRAPOLATED).all()  # only 256 KiB measured
    rows = tuning.decide(times, cands)
    assert rows[0][6][:2] == ("shm2", 0), times[6]
    assert rows[1][6][:2] == ("shm2", 0), times[6]
    assert times[6, 0, 1] > times[6, 0, 2] > 0


def test_set_up_in_the_warm_up_round_does_not_cut_the_calibration_short():
    """A candidate whose first call takes 0.5 s (its shared memory's first touch) and then
    10 us: every size up to 16 MiB is still measured within the 1 s budget (the prediction
    comes from the timed rounds, not from the wall time the warm-up took)."""
    run = Costs(lambda name, i: 0.5 if (name == "shm2" and i == 0) else 10e-6)
    cands = [("mpi", 0), ("shm2", 0)]
    times = tuning.measure(MPI.COMM_SELF, cands, run)
    assert not (times[:, :, 0] == tuning.EXTRAPOLATED).any(), times[:, :, 0]
    assert np.isfinite(times).all()


def test_a_budget_spent_before_1_mib_is_used_but_not_cached(tmp_path, monkeypatch):
    """Every call slow (the ranks' cores busy with other work while they calibrate): the
    budget runs out at a small size; the table serves this communicator, the cache stays
    empty, and the reason says so."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("DTRUN_TUNE_MAX_LOAD", "1000")
    run = Costs(lambda name, i: 8e-3)
    cands = [("mpi", 0), ("shm1", 0)]
    table = tuning.calibrated(MPI.COMM_SELF, "h1", 1, 1, cands, run)
    assert "not cached: the time budget ran out before" in table.source, table.source
    cache_file = tmp_path / "dtrun" / tuning.CACHE_FILE
    assert not cache_file.exists() or not json.loads(cache_file.read_text())
    # A quick measurement is cached, and read back by the next communicator.
    quick = tuning.calibrated(MPI.COMM_SELF, "h1", 1, 1, cands, Costs(lambda name, i: 5e-6))
    assert "(now," in quick.source and "not cached" not in quick.source, quick.source
    again = tuning.calibrated(MPI.COMM_SELF, "h1", 1, 1, cands, Costs(lambda name, i: 1.0))
    assert "(cached," in again.source


def test_each_size_measured_is_reported_as_progress():
    """A calibration across hosts takes seconds: after each size it measured, ``tick`` hears
    of it (Comm records it in the flight recorder, which a hang watch reads as progress)."""
    seen = []
    run = Costs(lambda name, i: 5e-6)
    times = tuning.measure(MPI.COMM_SELF, [("mpi", 0), ("ring", 0)], run, first=4, rounds=(2, 2),
                           budget=30.0, tick=seen.append)
    assert seen == list(tuning.BUCKETS[4:]), seen
    assert not (times[:, :, 0] == tuning.EXTRAPOLATED).any()
