"""The Horovod adapter's negotiation engine (collectives/horovod/_engine.py) on 2 real ranks:
background progress, collectives from several threads, the deadlock error and process sets.
tests/horovod_engine_cases.py is the rank program (NumPy only)."""

from __future__ import annotations

import sys

import pytest

from tests.dtrun_helpers import REPO, dtrun
from tests.horovod_common import results

CASES = str(REPO / "tests" / "horovod_engine_cases.py")


def _run(case: str, *env: str, timeout: int = 120) -> list[dict]:
    extra = [a for kv in env for a in ("-x", kv)]
    proc = dtrun("-np", 2, "-H", "localhost:2", "--oversubscribe", *extra, sys.executable,
                 CASES, case, timeout=timeout)
    return results(proc, 2)


@pytest.mark.mpi
def test_a_submitted_collective_completes_without_poll_or_synchronize():
    r0, r1 = _run("background")
    assert r0["done_by_itself"] is True
    assert r0["value"] == r1["value"] == [3.0, 3.0, 3.0]


@pytest.mark.mpi
def test_collectives_from_several_threads_pair_by_name_in_any_order():
    r0, r1 = _run("threads")
    want = {f"t{i}": 20.0 * i + 1 for i in range(4)}  # (10 i + 0) + (10 i + 1)
    assert r0["sums"] == r1["sums"] == want


@pytest.mark.mpi
def test_a_deadlock_is_an_error_naming_what_each_rank_waits_for():
    r0, r1 = _run("deadlock", "DTRUN_HVD_DEADLOCK_S=1")
    for r in (r0, r1):
        kind, msg = r["error"]
        assert kind == "HorovodMismatchError", r["error"]
        assert ("deadlock: no collective was submitted by every rank (rank 0 has "
                "['only_on_0'] pending; rank 1 has ['only_on_1'] pending) for 1 s") in msg, msg
        assert msg.startswith(f"allreduce on rank {r['rank']}: ")
        assert 1 <= r["waited"] < 30
        assert r["after"] == [2.0, 2.0, 2.0]


@pytest.mark.mpi
def test_process_sets_run_their_own_collectives():
    r0, r1 = _run("sets")
    for r in (r0, r1):
        assert r["same_job"] is True
        assert r["ids"] == [1, 2, 3]
        assert r["both_set"] == [2.0, 2.0, 2.0]
        assert r["non_member"][0] == "ValueError"
        assert f"rank {r['rank']} is not in ProcessSet(process_set_id=" in r["non_member"][1]
        assert r["duplicate"] == [
            "ValueError", "add_process_set: a process set with ranks [0, 1] is already "
            "registered (id 3)"]
        assert r["removed"] == [True, True, True]
        assert r["after_remove"][0] == "ValueError"
        assert r["bad_op"][0] == "ValueError"
    assert r0["included"] == [True, False, True] and r1["included"] == [False, True, True]
    assert r0["own_set"] == [5.0] * 3 and r1["own_set"] == [6.0] * 3
