"""The communicator's parts behave as their contracts say: fusion plans are built once per
list of arrays and reused, and one Comm per process owns the flight recorder."""

import numpy as np
import pytest

from dtrun.collectives import comm as comm_mod
from dtrun.collectives import fusion, recorder


@pytest.fixture
def comm():
    c = comm_mod.Comm()
    yield c
    c.free()


def test_fusion_plan_is_built_once_and_reused(comm):
    arrays = [np.full(3, 2.0), np.ones(4), np.arange(5, dtype=np.float32), np.ones(1 << 18)]
    comm.grouped_allreduce(arrays)
    assert comm._plans.built == 1
    plan = next(iter(comm._plans.cache.values()))
    # The two small float64 arrays share a fused step; the lone float32 one and the
    # 2 MiB one are reduced alone.
    assert sorted(type(s).__name__ for s in plan.steps) == ["Alone", "Alone", "Fused"]
    assert any(type(s) is fusion.Alone and s.array is arrays[3] for s in plan.steps)
    comm.grouped_allreduce(arrays)
    assert comm._plans.built == 1, "the same list again must reuse the cached plan"
    assert next(iter(comm._plans.cache.values())) is plan
    np.testing.assert_array_equal(arrays[0], np.full(3, 2.0 * comm.size ** 2))
    other = [np.full(3, 1.0), np.arange(5, dtype=np.float32)]
    comm.grouped_allreduce(other)
    assert comm._plans.built == 2, "a different list gets its own plan"


def test_fused_step_covers_its_arrays():
    arrays = [np.ones(4), np.zeros(0), np.full(2, 3.0)]
    (step,) = fusion._split(arrays, np.dtype(np.float64), 1 << 20)
    try:
        assert type(step) is fusion.Fused
        assert (step.count, step.nbytes) == (6, 48)
        flat = np.empty(6)
        step.pack(flat)
        assert flat.tolist() == [1.0] * 4 + [3.0] * 2
        step.unpack(flat * 10)
        assert arrays[0].tolist() == [10.0] * 4 and arrays[2].tolist() == [30.0] * 2
    finally:
        step.datatype.Free()


def test_uncached_call_builds_every_time(comm):
    arrays = [np.ones(3), np.ones(2)]
    comm.grouped_allreduce(arrays, _cache=False)
    comm.grouped_allreduce(arrays, _cache=False)
    assert comm._plans.built == 2 and not comm._plans.cache


def test_one_recorder_writer_per_process(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRUN_JOB_DIR", str(tmp_path))
    monkeypatch.setattr(recorder, "OWNER", recorder.Owner())
    first, second = comm_mod.Comm(), comm_mod.Comm()
    try:
        assert first._rec is not None and second._rec is None
        first.barrier()
        entries = recorder.decode(open(recorder.path_for(str(tmp_path), first.rank), "rb").read())
        assert [e["op"] for e in entries["entries"]] == ["barrier"]
    finally:
        first.free()
        second.free()
