"""The collectives runtime: every case in-process on one rank, and under dtrun on 2 and
3 ranks; smoke (including injected wrong values and hangs), bench and the examples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.collectives_cases import CASES, Skip, run_cases
from tests.dtrun_helpers import REPO, dtrun, user_env

PYTHON = sys.executable


def launch(n: int, *program: str, timeout: float = 120, env_vars: dict | None = None,
           ) -> subprocess.CompletedProcess:
    """``dtrun -np n -H localhost:n --oversubscribe python ...`` as a user runs it."""
    forwards = []
    for name in env_vars or {}:
        forwards += ["-x", name]
    return dtrun("-np", n, "-H", f"localhost:{n}", "--oversubscribe", *forwards, PYTHON,
                 *program, timeout=timeout, env=user_env(**(env_vars or {})))


def reports(proc: subprocess.CompletedProcess) -> list[dict]:
    found = []
    for line in proc.stdout.splitlines():
        at = line.find("CASES {")
        if at >= 0:
            found.append(json.loads(line[at + 6:]))
    return sorted(found, key=lambda r: r["rank"])


# ----------------------------------------------------------------------------- one rank
@pytest.fixture(scope="module")
def comm1():
    from dtrun import collectives
    comm = collectives.init()
    assert comm.size == 1, "the in-process tests expect a singleton MPI (no mpirun)"
    yield comm


@pytest.mark.parametrize("name", list(CASES))
def test_case_one_rank(comm1, name):
    try:
        CASES[name](comm1)
    except Skip as s:
        pytest.skip(str(s))


# ----------------------------------------------------------------------------- 2 and 3 ranks
_RUNS: dict[int, tuple[subprocess.CompletedProcess, list[dict]]] = {}


def multi_rank(n: int):
    """Run all cases once per rank count (cached for the per-case tests)."""
    if n not in _RUNS:
        proc = launch(n, "-m", "tests.collectives_cases", timeout=180)
        _RUNS[n] = (proc, reports(proc))
    return _RUNS[n]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_case_multi_rank(n, name):
    proc, reps = multi_rank(n)
    assert len(reps) == n, (f"expected a report from each of {n} ranks, got {len(reps)}\n"
                            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    failures = {r["rank"]: r["failed"][name] for r in reps if name in r["failed"]}
    assert not failures, "\n".join(f"--- rank {k} ---\n{tb}" for k, tb in failures.items())
    skipped = [r["skipped"][name] for r in reps if name in r["skipped"]]
    if skipped:
        pytest.skip(skipped[0])
    assert all(name in r["passed"] for r in reps)


@pytest.mark.mpi
def test_path_cases_on_four_ranks():
    """Two emulated hosts of 2 ranks: the only layout here with every inter-host path
    (shm+hierarchical, shm+ring, ring, stream) and a shared-memory step on each host."""
    names = "hierarchical,hierarchical_paths,ring_exact,path_selection_agrees,stream_exact"
    proc = launch(4, "-m", "tests.collectives_cases", "--only", names, timeout=240)
    reps = reports(proc)
    assert len(reps) == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in reps:
        assert not r["failed"], "\n".join(r["failed"].values())
        assert sorted(r["passed"]) == sorted(names.split(","))
    assert proc.returncode == 0


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_case_runner_exit_code(n):
    proc, _ = multi_rank(n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_run_cases_reports_failures(comm1, monkeypatch):
    """The runner itself: a failing case is reported with its traceback, others pass."""
    import tests.collectives_cases as cases

    def case_broken(comm):
        raise AssertionError("deliberately broken")
    monkeypatch.setitem(cases.CASES, "broken", case_broken)
    report = run_cases(comm1, ["broken", "broadcast"])
    assert report["passed"] == ["broadcast"]
    assert "deliberately broken" in report["failed"]["broken"]


# ----------------------------------------------------------------------------- library bits
def test_import_does_not_start_mpi():
    code = ("import sys, collectives; assert 'mpi4py.MPI' not in sys.modules; "
            "from dtrun.collectives import CollectiveError, env_local_rank; "
            "assert 'mpi4py.MPI' not in sys.modules; print('lazy')")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 0 and "lazy" in out.stdout, out.stderr


def test_env_rank_helpers(monkeypatch):
    from dtrun.collectives import env_local_rank, env_local_size, env_rank, env_size
    monkeypatch.setenv("DTRUN_RANK", "5")
    monkeypatch.setenv("DTRUN_LOCAL_RANK", "1")
    monkeypatch.setenv("DTRUN_SIZE", "8")
    monkeypatch.setenv("DTRUN_LOCAL_SIZE", "4")
    assert (env_rank(), env_local_rank(), env_size(), env_local_size()) == (5, 1, 8, 4)
    for name in ("DTRUN_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                 "SLURM_LOCALID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    assert env_local_rank() == 3


def test_error_message_names_op_rank_and_problem(comm1):
    import numpy as np

    from dtrun.collectives import NotContiguousError
    with pytest.raises(NotContiguousError) as info:
        comm1.allreduce(np.zeros((3, 3))[:, 0])
    msg = str(info.value)
    assert msg.startswith("allreduce on rank 0: ") and "ascontiguousarray" in msg
    assert info.value.op == "allreduce" and info.value.rank == 0


def test_env_byte_sizes(monkeypatch):
    from dtrun.collectives.sizes import env_bytes
    for raw, want in [("64M", 64 << 20), ("4KiB", 4096), ("1g", 1 << 30), ("123", 123)]:
        monkeypatch.setenv("X_BYTES", raw)
        assert env_bytes("X_BYTES", 0) == want
    monkeypatch.setenv("X_BYTES", "lots")
    with pytest.raises(ValueError, match="X_BYTES='lots' is not a byte count"):
        env_bytes("X_BYTES", 0)


def test_bfloat16_rounding_matches_torch_convention():
    import numpy as np

    from dtrun.collectives import dtypes as dt
    vals = np.array([1.0, 1.00390625, 1.01171875, 3.0e38, -2.5, 0.0, 256.0, 257.0])
    b = dt.from_float64(vals, dt.BFLOAT16)
    back = dt.to_float64(b)
    # Round to nearest even on the 8-bit mantissa: 257 -> 256, 1.01171875 -> 1.015625.
    assert back[0] == 1.0 and back[6] == 256.0 and back[7] == 256.0
    assert back[2] == 1.015625 and back[4] == -2.5
    try:
        import torch
    except ImportError:
        return
    ref = torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(back, ref.astype(np.float64))


# ----------------------------------------------------------------------------- smoke
@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_smoke_passes(n):
    proc = launch(n, "-m", "dtrun.collectives.smoke", "--timeout", "60")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("collectives smoke test") == 1  # one table, printed by rank 0
    for op in ("allreduce", "alltoall", "reduce_scatter", "allgatherv", "grouped"):
        assert op in out
    assert f"checks on {n} ranks" in out and "PASS" in out and "FAIL" not in out
    for rank in range(n):
        assert f"│ {rank}    │" in out


@pytest.mark.mpi
def test_smoke_json():
    proc = launch(2, "-m", "dtrun.collectives.smoke", "--json", "--ops", "allreduce,broadcast",
                  "--sizes", "0,5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert doc["ok"] is True and doc["ops"] == ["allreduce", "broadcast"]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    for r in doc["ranks"]:
        assert r["device"] == "cpu" and r["local_rank"] in (0, 1)
        assert r["results"]["allreduce"]["ok"] and r["results"]["allreduce"]["checks"] > 0


@pytest.mark.mpi
def test_smoke_detects_wrong_value():
    proc = launch(3, "-m", "dtrun.collectives.smoke", "--ops", "allreduce,gather",
                  env_vars={"DTRUN_SMOKE_INJECT_ERROR": "allreduce:1"})
    assert proc.returncode != 0
    out = proc.stdout
    assert "FAIL rank 1" in out and "allreduce float32 n=1" in out and "got" in out
    assert "FAIL rank 0" not in out and "FAIL rank 2" not in out
    assert "FAIL:" in out


def _leftover(marker: str) -> list[str]:
    import psutil
    left = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "dtrun.collectives.smoke" in cmd and marker in cmd:
            left.append(f"{p.pid}: {cmd}")
    return left


@pytest.mark.mpi
def test_smoke_reports_hang_and_leaves_no_process():
    marker = "2.71828"
    t0 = time.monotonic()
    proc = launch(3, "-m", "dtrun.collectives.smoke", "--timeout", marker, "--ops",
                  "broadcast,allreduce", timeout=90,
                  env_vars={"DTRUN_SMOKE_INJECT_HANG": "allreduce:1"})
    took = time.monotonic() - t0
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "HANG: allreduce" in text and "did not complete within 2.71828 s on rank" in text
    assert took < 60, f"hang detection took {took:.0f} s"
    deadline = time.monotonic() + 10
    while _leftover(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _leftover(marker)


def test_smoke_usage_error():
    from dtrun.collectives import smoke
    assert smoke.main(["--ops", "nonsense"]) == 2


# ----------------------------------------------------------------------------- bench
@pytest.mark.mpi
def test_bench_json_sane():
    proc = launch(2, "-m", "dtrun.collectives.bench", "-b", "8", "-e", "64K", "-f", "8", "-n", "3",
                  "-w", "1", "-o", "all", "--baseline", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert doc["nranks"] == 2 and doc["wrong"] == 0 and doc["avg_busbw"] > 0
    ops = {r["op"] for r in doc["rows"]}
    assert ops == {"allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "reduce"}
    for r in doc["rows"]:
        assert r["oop_wrong"] == 0 and r["ip_wrong"] == 0
        for key in ("oop_time_us", "ip_time_us", "raw_oop_time_us", "oop_ratio"):
            assert r[key] > 0, (key, r)
        if r["size"] > 0:
            assert r["oop_algbw"] > 0 and r["oop_busbw"] > 0
        if r["op"] == "allreduce" and r["size"]:
            assert r["oop_busbw"] == pytest.approx(r["oop_algbw"] * 2 * (2 - 1) / 2)


@pytest.mark.mpi
def test_bench_memory_bound_columns():
    """--bound: memcpy's rate at each size, the bound under the stated accounting
    ((2 + (p-1)/p) N bytes at 2N per copy of N) and the fraction ours and raw MPI reach."""
    proc = launch(2, "-m", "dtrun.collectives.bench", "-b", "256K", "-e", "1M", "-f", "4", "-n", "2",
                  "-w", "1", "--baseline", "--bound", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout[proc.stdout.index("{"):])["rows"]
    assert [r["size"] for r in rows] == [256 << 10, 1 << 20]
    for r in rows:
        copy_us = r["size"] / (r["memcpy_GBps"] * 1e3)      # one memcpy of N bytes
        assert r["bound_us"] == pytest.approx(2.5 * r["size"] / (2 * r["size"] / copy_us))
        for v in ("oop", "ip"):
            assert r[f"{v}_bound_frac"] == pytest.approx(r["bound_us"] / r[f"{v}_time_us"])
            assert r[f"raw_{v}_bound_frac"] == pytest.approx(r["bound_us"] / r[f"raw_{v}_time_us"])


@pytest.mark.mpi
def test_bench_table_columns():
    proc = launch(3, "-m", "dtrun.collectives.bench", "-b", "1K", "-e", "4K", "-n", "2", "-w", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "size         count      type   redop    root     time   algbw   busbw #wrong" in out
    assert "# Avg bus bandwidth    :" in out and "# Out of bounds values : 0 OK" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]
    assert [int(r[0]) for r in rows] == [1024, 2048, 4096]
    for r in rows:
        assert r[2] == "float" and r[3] == "sum" and r[4] == "-1"
        assert float(r[5]) > 0 and r[8] == "0" and r[12] == "0"


@pytest.mark.mpi
def test_bench_grouped():
    proc = launch(2, "-m", "dtrun.collectives.bench", "-o", "grouped", "-b", "4K", "-e", "4K",
                  "--tensors", "64", "-n", "3", "-w", "1", "--baseline", "--bound", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout[proc.stdout.index("{"):])
    row = doc["rows"][0]
    assert row["tensors"] == 64 and row["wrong"] == 0 and row["speedup"] > 0
    # raw MPI's separate calls, and the ceiling the memory bound puts on fusion
    fused, sep = row["fused_time_us"], row["separate_time_us"]
    assert row["raw_speedup"] == pytest.approx(row["raw_separate_time_us"] / fused)
    assert row["bound_us"] > 0
    assert row["bound_frac"] == pytest.approx(row["bound_us"] / fused)
    assert row["speedup_at_bound"] == pytest.approx(sep / row["bound_us"])
    # the shared-memory barrier, timed before and after (2 ranks on this host: an engine)
    assert doc["shm_barrier_ns"] > 0 and doc["shm_barrier_ns_end"] > 0


def test_bench_size_parsing_and_usage():
    from dtrun.collectives import bench
    from dtrun.collectives.sizes import parse_bytes
    assert [parse_bytes(s) for s in ("8", "1K", "64M", "1G", "2KB", "1k")] == \
        [8, 1024, 64 << 20, 1 << 30, 2048, 1024]
    with pytest.raises(ValueError, match="'lots' is not a byte count"):
        parse_bytes("lots")
    assert bench.parse_args(["-b", "2KiB"]).minbytes == 2048
    assert bench.main(["-o", "nonsense"]) == 2
    args = bench.parse_args(["-b", "8", "-e", "64", "-f", "2"])
    assert bench.sizes(args) == [8, 16, 32, 64]


# ----------------------------------------------------------------------------- examples
EXAMPLES = ["p2p", "broadcast", "scatter", "gather", "reduce", "allreduce"]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("example", EXAMPLES)
def test_example(example, n):
    proc = launch(n, str(REPO / "examples" / f"{example}.py"), timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "WRONG" not in proc.stdout
    assert proc.stdout.strip()


@pytest.mark.parametrize("preset", [None, "^ucx,pt2pt"])
def test_import_and_init_leave_environment_alone(preset):
    """Neither importing collectives nor its MPI_Init leaves a change in os.environ."""
    code = (
        "import json, os\n"
        "before = dict(os.environ)\n"
        "from dtrun import collectives\n"
        "after_import = dict(os.environ)\n"
        "comm = collectives.init()\n"
        "from mpi4py import MPI\n"
        "print(json.dumps([before == after_import, before == dict(os.environ),\n"
        "                  os.environ.get('OMPI_MCA_osc'), comm.size]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    if preset is not None:
        env["OMPI_MCA_osc"] = preset
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    same_after_import, same_after_init, osc, size = json.loads(proc.stdout.strip().splitlines()[-1])
    assert same_after_import and same_after_init and size == 1
    assert osc == preset  # the user's own setting is kept as it was


# ----------------------------------------------------------------------------- path table
def test_one_host_candidates_and_shm1_below_1_mib():
    """On one host with the compiled engine the calibration times MPI, shm1 and shm2 (the
    Python path only without the engine; with it, the Python path can still be forced);
    shm1 is timed below 1 MiB only, and a size the budget
    left unmeasured takes shm2 where the size below took shm1 (the reason says so)."""
    import numpy as np

    from dtrun.collectives import tuning
    python = [("shm", c) for c in tuning.CHUNKS]
    offered = tuning.candidates(True, 1, True, 2, compiled=True)
    assert offered == [("mpi", 0), ("shm1", 0), ("shm2", 0)] + python  # each can be forced
    compiled = tuning.timed(offered)
    assert compiled == [("mpi", 0), ("shm1", 0), ("shm2", 0)]
    assert tuning.timed(tuning.candidates(True, 1, True, 2, compiled=False)) == [("mpi", 0)] + python
    b = tuning.BUCKETS
    assert tuning.applies(("shm1", 0), b[5]) and not tuning.applies(("shm1", 0), b[6])
    assert tuning.applies(("shm2", 0), b[8]) and tuning.SHM1_MAX == b[6] == 1 << 20
    times = np.full((len(b), 2, 3), np.inf)
    times[:, :, 0] = 1.0
    times[:, :, 1] = 0.5   # shm1 fastest wherever it is timed ...
    times[:, :, 2] = 0.6
    times[6:, :, 1] = np.inf  # ... which is below 1 MiB
    rows = tuning.decide(times, compiled)
    assert [r[0] for r in rows[0]] == ["shm1"] * 6 + ["shm2"] * 3
    times[6:, :, 0] = tuning.EXTRAPOLATED  # from 1 MiB not measured (budget)
    rows = tuning.decide(times, compiled)
    assert [r[0] for r in rows[1]] == ["shm1"] * 6 + ["shm2"] * 3
    why = tuning.Table(rows, "calibrated on test").explain(4 << 20, True)
    assert why.startswith("shm2:") and "as at 256 KiB in place (shm2 for shm1 from 1 MiB)" in why, why


def test_across_hosts_stream_is_timed_from_4_mib_matches_mpi_and_takes_unmeasured_sizes():
    """Across hosts the streaming TCP ring is a candidate, timed from 4 MiB up. It needs
    only to match MPI (the other paths must beat it by the hosts' margin); a size from
    4 MiB up that the budget left unmeasured takes it (the reason says so); below 4 MiB
    the size below decides, as before."""
    import numpy as np

    from dtrun.collectives import tuning
    b = tuning.BUCKETS
    cands = tuning.candidates(False, 2, True, 1)
    assert cands == [("mpi", 0), ("ring", 0), ("stream", 0)] == tuning.timed(cands)
    assert ("stream", 0) not in tuning.candidates(True, 1, True, 2, compiled=True)
    assert tuning.STREAM_FROM == b[7] == 4 << 20
    assert not tuning.applies(("stream", 0), b[6]) and tuning.applies(("stream", 0), b[7])
    times = np.full((len(b), 2, 3), np.inf)
    times[:, :, 0] = 1.0
    times[:, :, 1] = 0.9  # the MPI ring: not under the hosts' margin (0.8) of MPI
    times[7:, 0, 2] = 1.0  # out of place, stream as fast as MPI: stream
    times[7:, 1, 2] = 1.1  # in place, slower: MPI
    rows = tuning.decide(times, cands, margin=tuning.HOSTS_MARGIN)
    assert [r[0] for r in rows[0]] == ["mpi"] * 7 + ["stream"] * 2
    assert [r[0] for r in rows[1]] == ["mpi"] * 9
    times[6:, :, 0] = tuning.EXTRAPOLATED  # from 1 MiB not measured (budget)
    rows = tuning.decide(times, cands, margin=tuning.HOSTS_MARGIN)
    assert [r[0] for r in rows[1]] == ["mpi"] * 7 + ["stream"] * 2
    table = tuning.Table(rows, "calibrated on test")
    assert table.pick(13_700_000, True) == ("stream", 0) and table.pick(2 << 20, True)[0] == "mpi"
    why = table.explain(16 << 20, True)
    assert why.startswith("stream:") and "as at 256 KiB in place (stream from 4 MiB)" in why, why


def test_path_table_decides_fastest_and_mpi_on_ties():
    import numpy as np

    from dtrun.collectives import tuning
    cands = [("mpi", 0), ("shm", tuning.CHUNKS[0]), ("shm", tuning.CHUNKS[1])]
    times = np.full((len(tuning.BUCKETS), 2, 3), np.inf)
    times[:, :, 0] = 1.0
    times[:4, :, 1] = 2.0          # small sizes: MPI faster
    times[4:, 0, 1] = 0.5          # larger, out of place: shm chunk 0 faster
    times[4:, 1, 1] = 0.98         # in place: within the margin, MPI kept
    times[6:, 0, 2] = 0.25         # largest: the second chunk faster still
    times[8:, :, 0] = -1.0         # the last bucket not measured (budget)
    rows = tuning.decide(times, cands)
    assert [r[0] for r in rows[0][:4]] == ["mpi"] * 4 and [r[0] for r in rows[1]] == ["mpi"] * 9
    assert rows[0][4][:2] == ("shm", tuning.CHUNKS[0]) and rows[0][7][:2] == ("shm", tuning.CHUNKS[1])
    assert rows[0][8] == ("shm", tuning.CHUNKS[1], -1.0, -1.0)  # as the size below
    table = tuning.Table(rows, "calibrated on test")
    b = tuning.BUCKETS
    assert table.floor == b[4]
    # A size takes the largest bucket not above it; above the last, the last.
    assert table.pick(b[4] - 1, False) == ("mpi", 0)
    assert table.pick(b[4], False) == ("shm", tuning.CHUNKS[0])
    assert table.pick(b[6] - 1, False) == ("shm", tuning.CHUNKS[0])
    assert table.pick(b[6], False) == ("shm", tuning.CHUNKS[1])
    assert table.pick(1 << 30, False) == ("shm", tuning.CHUNKS[1])
    assert table.pick(1 << 30, True) == ("mpi", 0)
    assert "shm 2.00x mpi at 64 KiB out of place" in table.explain(b[4])
    assert "not measured at 16 MiB" in table.explain(64 << 20) and "as at 4 MiB" in \
        table.explain(64 << 20)
    assert tuning._valid_rows(rows, cands)
    assert not tuning._valid_rows(rows, cands[:1])           # a path this layout lacks
    assert not tuning._valid_rows([rows[0]], cands)          # one variant missing
    assert not tuning._valid_rows([[("mpi", 0, "x", 1)] * 9] * 2, cands)
    # Across hosts the small sizes are not measured: MPI, and the reason says so.
    times[:tuning.HOSTS_FIRST, :, 0] = tuning.NOT_MEASURED
    rows = tuning.decide(times, cands)
    assert rows[0][0] == ("mpi", 0, tuning.NOT_MEASURED, tuning.NOT_MEASURED)
    assert tuning._valid_rows(rows, cands)
    assert "latency-bound and not measured" in tuning.Table(rows, "x").explain(1000)
    # Across hosts another path must be clearly faster: 0.5x MPI's time leaves MPI, 0.85x
    # (a "win" the size of the network's noise) does not.
    times[6:, 0, 2] = np.inf
    times[4:6, 0, 1] = 0.85
    rows = tuning.decide(times, cands, tuning.HOSTS_MARGIN)
    assert [r[0] for r in rows[0][4:8]] == ["mpi", "mpi", "shm", "shm"]


def test_fixed_rule_table():
    from dtrun.collectives import tuning
    t = tuning.Table.fixed("shm", 1 << 20, 64 << 10, "env DTRUN_SHM_THRESHOLD=1M")
    assert t.pick((1 << 20) - 1, False) == ("mpi", 0)
    assert t.pick(1 << 20, True) == ("shm", 64 << 10)
    assert t.explain(8 << 20) == ("shm (chunk 64 KiB): env DTRUN_SHM_THRESHOLD=1M: shm at or "
                                  "above 1 MiB, chunk 64 KiB; mpi below")


def test_cache_file_corrupt_or_missing_reads_empty(tmp_path):
    from dtrun.collectives import cache
    f = tmp_path / "dtrun" / "c.json"
    assert cache.load(f) == {}
    f.parent.mkdir()
    for junk in (b"{oops", b"[1]", b"\xff\xfe\x00", b""):
        f.write_bytes(junk)
        assert cache.load(f) == {}
    assert cache.save(f, {"a": 1}) and cache.load(f) == {"a": 1}
    assert not list(f.parent.glob(".*.tmp"))


def test_compiled_rows_stop_where_the_table_first_leaves_the_compiled_paths():
    """The compiled allreduce takes sizes in Table.compiled_rows() without entering Python:
    shm1 and shm2 rows as the table has them, up to the first size whose decision is
    another path."""
    from dtrun.collectives import tuning
    b = tuning.BUCKETS
    row = lambda paths: [(p, 0, 1.0, 1.0) for p in paths]  # noqa: E731
    rows = [row(["shm1"] * 2 + ["shm2"] + ["shm"] * 3 + ["shm1"] * 3), row(["mpi"] + ["shm1"] * 8)]
    t = tuning.Table(rows, "test")
    # 0-1 KiB shm1, 1-4 KiB shm2, then none: not b[8], 16 KiB-1 MiB take shm
    assert t.compiled_rows(False) == ((b[2], 1), (b[3], 2))
    assert t.compiled_rows(True) == ()         # 256 B and below take MPI
    assert t.pick(b[6], False) == ("shm1", 0)  # past the last bound, Python picks it again
    assert tuning.Table([row(["shm2", "shm1"] + ["shm2"] * 7)] * 2, "t").compiled_rows(True) == \
        ((b[1], 2), (b[2], 1), (1 << 62, 2))
    assert tuning.Table.fixed("shm1", 0, 0, "forced").compiled_rows(False) == ((1 << 62, 1),)
    assert tuning.Table.fixed("shm2", 0, 0, "forced").compiled_rows(True) == ((1 << 62, 2),)
    assert tuning.Table.fixed("shm", 0, 1 << 20, "forced").compiled_rows(False) == ()
    assert tuning.Table.fixed("shm1", 0, 0, "forced").explain(8).startswith("shm1: forced")


def test_compiled_engine_is_built_where_a_compiler_is():
    """`pip install -e .` builds collectives._fastshm when cc and Python's headers exist (CI
    has both): without this test a failed build would fall back silently to slower paths."""
    import shutil
    import sysconfig
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not (shutil.which("cc") or shutil.which("gcc")) or not os.path.exists(header):
        pytest.skip(f"no C compiler or no {header}: the pure-Python paths are used")
    from dtrun.collectives import shm1
    assert shm1._fastshm is not None, "dtrun.collectives._fastshm did not build: run `pip install -e .` and read its errors"
    assert shm1.available()


@pytest.mark.mpi
def test_cases_without_the_compiled_engine():
    """DTRUN_COMPILED=0: the pure-Python paths and recorder store (as on a machine that could
    not build the engine) pass the same allreduce cases, and shm1 is not offered."""
    names = "allreduce_ops,allreduce_forms,allreduce_shm_exact,path_selection_agrees,grouped,shm1_exact"
    proc = launch(2, "-m", "tests.collectives_cases", "--only", names, timeout=180,
                  env_vars={"DTRUN_COMPILED": "0"})
    reps = reports(proc)
    assert len(reps) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in reps:
        assert not r["failed"], "\n".join(r["failed"].values())
        assert r["skipped"] == {"shm1_exact": "the compiled engine is not in use here: DTRUN_COMPILED=0"}
    bad = launch(2, "-c", "from dtrun import collectives; collectives.init()", timeout=60,
                 env_vars={"DTRUN_COMPILED": "yes"})
    assert bad.returncode != 0 and "DTRUN_COMPILED='yes'" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.mpi
def test_ctrl_c_reaches_a_rank_waiting_in_the_compiled_allreduce(tmp_path):
    """A rank blocked in shm1 (its peer never arrives) still answers SIGINT: the wait checks
    for signals while it sleeps, so the rank raises KeyboardInterrupt where it waits."""
    import signal
    prog = tmp_path / "wait_in_shm1.py"
    prog.write_text(
        "import os, sys, time\nimport numpy as np\nfrom dtrun import collectives\n"
        "c = collectives.Comm(path='shm1')\n"
        f"open(os.path.join({str(tmp_path)!r}, 'rank%d.pid' % c.rank), 'w').write(str(os.getpid()))\n"
        "if c.rank == 1:\n    time.sleep(60)\n    sys.exit(0)\n"
        "try:\n    c.allreduce(np.ones(4, np.float32))\n"
        "except KeyboardInterrupt:\n    print('rank 0: interrupted in allreduce', flush=True)\n    os._exit(7)\n")
    from tests.dtrun_helpers import DTRUN
    proc = subprocess.Popen([DTRUN, "-np", "2", "-H", "localhost:2", PYTHON,
                             str(prog)], cwd=REPO, env=user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pidfile = tmp_path / "rank0.pid"
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "rank 0 never started"
            time.sleep(0.1)
        time.sleep(1.0)  # rank 0 is asleep on rank 1's counter by now
        os.kill(int(pidfile.read_text()), signal.SIGINT)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "rank 0: interrupted in allreduce" in out, out + err
    assert proc.returncode == 7, err
