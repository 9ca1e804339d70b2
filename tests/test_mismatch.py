"""Ranks that call a collective with different arguments: every rank raises MismatchError
naming both sides, by default and with DTRUN_CHECK=1, on every path (real ranks under
dtrun; tests/mismatch_cases.py holds the matrix). Also: grouped_allreduce refuses
read-only arrays, and an ``out`` overlapping the input is refused."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from tests.dtrun_helpers import PYTHON, dtrun, user_env
from tests.mismatch_cases import CASES

_RUNS: dict[tuple, tuple[subprocess.CompletedProcess, dict]] = {}


def _run(n: int, check: str) -> tuple[subprocess.CompletedProcess, dict]:
    """All cases on ``n`` ranks with DTRUN_CHECK=``check`` ("" for unset); cached."""
    key = (n, check)
    if key not in _RUNS:
        env = {"DTRUN_CHECK": check} if check else {}
        forward = ["-x", "DTRUN_CHECK"] if check else []
        try:
            proc = dtrun("-np", n, "-H", f"localhost:{n}", "--oversubscribe", *forward, PYTHON,
                         "-m", "tests.mismatch_cases", timeout=600, env=user_env(**env))
        except subprocess.TimeoutExpired as e:  # the safety net: the assertion names it
            proc = subprocess.CompletedProcess(e.cmd, -9, e.stdout or "", e.stderr or "")
            proc.stdout = proc.stdout if isinstance(proc.stdout, str) else proc.stdout.decode()
        results: dict[str, dict[int, dict]] = {}
        for line in proc.stdout.splitlines():
            at = line.find("MISMATCH {")
            if at >= 0:
                r = json.loads(line[at + 9:])
                results.setdefault(r["case"], {})[r["rank"]] = r
        _RUNS[key] = (proc, results)
    return _RUNS[key]


@pytest.mark.mpi
@pytest.mark.parametrize("check", ["", "1"], ids=["default", "DTRUN_CHECK=1"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_naming_both_sides(n, check, name):
    proc, results = _run(n, check)
    got = results.get(name, {})
    hung = f"MISMATCH-HANG {name}" in proc.stdout
    assert not hung, f"{name}: hung (no rank returned within the case timeout)"
    assert sorted(got) == list(range(n)), (
        f"{name}: reports from ranks {sorted(got)} of {n}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    for rank, r in sorted(got.items()):
        assert r["status"] == "raised", f"{name} rank {rank}: {r['status']}: {r['message']}"
        for needle in CASES[name][2]:
            assert needle in r["message"], f"{name} rank {rank}: {needle!r} not in {r['message']!r}"
        assert f"on rank {rank}:" in r["message"]


@pytest.mark.mpi
def test_hierarchical_paths_on_four_ranks():
    """Emulated hosts of 2 ranks: shm+hierarchical and the others across hosts."""
    names = ",".join(k for k in CASES if k.endswith("_hosts"))
    proc = dtrun("-np", 4, "-H", "localhost:4", "--oversubscribe", PYTHON, "-m",
                 "tests.mismatch_cases", "--only", names, timeout=600, env=user_env())
    reps = [json.loads(line[line.find("MISMATCH {") + 9:]) for line in proc.stdout.splitlines()
            if "MISMATCH {" in line]
    assert "MISMATCH-HANG" not in proc.stdout, proc.stdout[-2000:]
    assert len(reps) == 4 * len(names.split(",")), proc.stdout[-2000:] + proc.stderr[-2000:]
    bad = [r for r in reps if r["status"] != "raised"]
    assert not bad, bad[:3]


# ----------------------------------------------------------------------------- local checks
@pytest.fixture(scope="module")
def comm1():
    from dtrun import collectives
    return collectives.init()


def test_grouped_refuses_read_only_arrays(comm1):
    from dtrun.collectives import ReadOnlyError
    blob = bytes(16)
    arrays = [np.zeros(3), np.frombuffer(blob, np.int32)]
    with pytest.raises(ReadOnlyError, match=r"array 1 \(shape \(4,\), int32\) is read-only"):
        comm1.grouped_allreduce(arrays)
    assert blob == bytes(16)
    frozen = np.ones(5, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ReadOnlyError, match="array 0"):
        comm1.grouped_allreduce([frozen])


def test_inplace_refuses_read_only_arrays(comm1):
    from dtrun.collectives import ReadOnlyError
    x = np.frombuffer(bytes(16), np.int32)
    with pytest.raises(ReadOnlyError, match="read-only"):
        comm1.allreduce(x, inplace=True)
    with pytest.raises(ReadOnlyError, match="out is read-only"):
        comm1.allreduce(np.ones(4, np.int32), out=x)


@pytest.mark.parametrize("call", ["allreduce", "iallreduce", "reduce", "allgather",
                                  "allgatherv", "gatherv", "reduce_scatter", "alltoall",
                                  "gather", "scatter"])
def test_out_overlapping_input_is_refused(comm1, call):
    from dtrun.collectives import OverlapError
    buf = np.arange(8, dtype=np.float32)
    x, out = buf[:4], buf[2:6]
    with pytest.raises(OverlapError, match="out overlaps x"):
        getattr(comm1, call)(x, out=out)
    np.testing.assert_array_equal(buf, np.arange(8, dtype=np.float32))


def test_out_overlap_refused_by_the_compiled_entry():
    """The compiled engine's allreduce (2 ranks, shm1) hands an overlapping out to Python."""
    code = ("import numpy as np, collectives\n"
            "from dtrun.collectives import shm1\n"
            "c = collectives.Comm(path='shm1') if shm1.available() else collectives.init()\n"
            "buf = np.arange(8, dtype=np.float32)\n"
            "try:\n    c.allreduce(buf[:4], out=buf[2:6]); print('RESULT returned', buf.tolist())\n"
            "except collectives.OverlapError as e:\n    print('RESULT refused', e)\n")
    proc = dtrun("-np", 2, "-H", "localhost:2", "--oversubscribe", PYTHON, "-c", code,
                 timeout=120, env=user_env())
    lines = [ln for ln in proc.stdout.splitlines() if "RESULT" in ln]
    assert len(lines) == 2 and all("RESULT refused" in ln and "out overlaps x" in ln
                                   for ln in lines), proc.stdout + proc.stderr


def test_signature_words_describe_what_each_rank_called():
    from dtrun.collectives import signature as sig
    a = (sig.meta("allreduce", "float32", "sum", "shm1"), 10, 0)
    b = (sig.meta("broadcast", "int64", None, None, 3), 7, 0)
    text = sig.explain([a, b, a])
    assert text == ("ranks 0, 2: allreduce of 10 x float32 (op sum, path shm1); "
                    "rank 1: broadcast of 7 x int64 (root 3)")
    g1 = sig.group_words([np.zeros(8, np.float32)] * 2, "sum", 1 << 26)
    g2 = sig.group_words([np.zeros(16, np.float32)] * 2, "sum", 1 << 26)
    g3 = sig.group_words([np.zeros(16, np.float32), np.zeros(16, np.int32)], "sum", 1 << 26)
    assert len({g1, g2, g3}) == 3 and g2[:2] == g3[:2]  # same count, the fingerprint differs
    assert "2 arrays, 16 elements" in sig.describe(g1)


@pytest.mark.parametrize("value, signatures, full", [(None, True, False), ("0", False, False),
                                                     ("1", True, True)])
def test_dtrun_check_selects_the_checks(monkeypatch, value, signatures, full):
    """Unset: the signature check only; DTRUN_CHECK=0: none (the benchmark's "without");
    DTRUN_CHECK=1: the full exchange as well."""
    from dtrun.collectives import comm as comm_mod
    if value is None:
        monkeypatch.delenv("DTRUN_CHECK", raising=False)
    else:
        monkeypatch.setenv("DTRUN_CHECK", value)
    c = comm_mod.Comm()
    try:
        assert (c.signatures, c.check) == (signatures, full)
    finally:
        c.free()
