"""`make bench`: the runtime's allreduce against raw mpi4py in a plain loop, in and out of place.

What a user's own timing loop meets, not the bench's median rounds: each run is a fresh
2- or 3-rank job on localhost that, per size (8 B to 64 MiB), times a loop of the same call
for each of ``comm.Allreduce(MPI.IN_PLACE, b)``, ``cc.allreduce(b, inplace=True)``,
``comm.Allreduce(b, o)``, ``cc.allreduce(b, out=o)`` and raw in place once more (a
barrier before each loop, the five in alternating order, 8 loops each, as many calls per
loop as raw in place makes in about 20 ms, at least 3) and reports ours/raw speed (raw
time / our time) from each variant's median loop, with the path ours took, and raw / raw:
the first raw in-place loop against the second, the noise of the measure itself. Several
runs, because a run is one core placement: the slowest run is the figure that counts.

Each run also times, on 2 ranks in place, how the compiled engine writes its slots: cached
stores, streaming stores, and the default that chooses per call (``--no-writes`` skips it).

Writes bench-results/inplace_loop.md and .json. Exit code 0 unless a run fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collectives import BIN, OUT_DIR, REPO, launcher  # noqa: E402

SIZES = (8, 256, 4096, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
GOAL = 0.95

# Both rank programs time their variants the same way (W: MPI.COMM_WORLD).
TIME_LOOPS = """
def time_loops(calls, first, after=None):
    # warm: the first calls set up windows and caches
    for call in calls.values():
        call()
    # calls per loop: a loop of ``first`` lasts about 20 ms (the same count on every rank)
    t = time.perf_counter()
    for _ in range(3):
        calls[first]()
    per_call = W.allreduce((time.perf_counter() - t) / 3, op=MPI.MAX)
    reps = max(3, min(2000, int(0.02 / max(per_call, 1e-7))))
    times = {k: [] for k in calls}
    for rnd in range(8):
        for k in (list(calls) if rnd % 2 == 0 else list(calls)[::-1]):
            W.Barrier()
            t = time.perf_counter()
            for _ in range(reps):
                calls[k]()
            times[k].append(W.allreduce((time.perf_counter() - t) / reps, op=MPI.MAX))
            if after is not None:
                after(k)
    return {k: statistics.median(v) for k, v in times.items()}
"""

RANK_PROGRAM = """
import json, statistics, time
import numpy as np
from mpi4py import MPI
import dtrun.collectives as cc

c = cc.init()
W = MPI.COMM_WORLD
TIME_LOOPS
rows = []
for size in SIZES:
    b = np.ones(max(size // 4, 2), np.float32)
    o = np.empty_like(b)
    barrier_ns = c.shm_barrier_ns(2000)  # where the ranks' cores are (docs/performance.md)
    calls = {"raw_ip": lambda: W.Allreduce(MPI.IN_PLACE, b), "ours_ip": lambda: c.allreduce(b, inplace=True),
             "raw_oop": lambda: W.Allreduce(b, o), "ours_oop": lambda: c.allreduce(b, out=o),
             "raw_ip2": lambda: W.Allreduce(MPI.IN_PLACE, b)}
    med = time_loops(calls, "raw_ip")
    rows.append({"size": size, "ip": med["raw_ip"] / med["ours_ip"], "oop": med["raw_oop"] / med["ours_oop"],
                 "aa": med["raw_ip"] / med["raw_ip2"],
                 "ip_path": c.allreduce_path(size, True), "oop_path": c.allreduce_path(size, False),
                 "raw_ip_us": med["raw_ip"] * 1e6, "ours_ip_us": med["ours_ip"] * 1e6,
                 "barrier_ns": barrier_ns})
if W.rank == 0:
    print("LOOP " + json.dumps(rows), flush=True)
"""


# How the compiled engine writes its slots (collectives/_fastshm.c: cached stores, streaming
# stores, or chosen per call by the time of a synchronisation round), 2 ranks, in place,
# against raw MPI in the same alternation; "round" is the auto mode's last timed round.
WRITES_SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
WRITES_PROGRAM = """
import json, statistics, time
import numpy as np
from mpi4py import MPI
import dtrun.collectives as cc

W = MPI.COMM_WORLD
TIME_LOOPS
c = cc.Comm(W, path="shm2")
e = c._engine
rows = []
for size in SIZES:
    b = np.ones(size // 4, np.float32)
    def mode(m):
        def call():
            e.nt_mode = m
            c.allreduce(b, inplace=True)
        return call
    calls = {"raw": lambda: W.Allreduce(MPI.IN_PLACE, b), "cached": mode(0), "streaming": mode(1),
             "auto": mode(-1)}
    rounds = []
    med = time_loops(calls, "raw", lambda k: rounds.append(e.nt_last_ns) if k == "auto" else None)
    rows.append({"size": size, **{k: med["raw"] / med[k] for k in ("cached", "streaming", "auto")},
                 "round_ns": statistics.median(rounds)})
if W.rank == 0:
    print("LOOP " + json.dumps(rows), flush=True)
"""


def one_run(nranks: int, program: str = RANK_PROGRAM, sizes: tuple = SIZES) -> list[dict]:
    import subprocess

    code = program.replace("TIME_LOOPS", TIME_LOOPS).replace("SIZES", repr(sizes))
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    p = subprocess.run(launcher(nranks) + [sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=900, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    for line in p.stdout.splitlines():
        if line.startswith("LOOP "):
            return json.loads(line[5:])
    raise SystemExit(f"bench_inplace_loop: the {nranks}-rank run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")


def mib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def report(results: dict[int, list[list[dict]]]) -> str:
    lines = ["# allreduce in a plain loop: ours / raw mpi4py", "",
             "Each cell: ours/raw speed (raw time / our time, above 1 is faster) of each run, "
             "then the path ours took. A fresh job per run, 2 and 3 ranks on localhost; in each "
             "run the five loops (raw and ours, in and out of place, raw in place again) alternate, 8 loops each, "
             f"median loop. Goal: at least {GOAL} in every run. The path: what ours took, in "
             "each run's path table. raw / raw: raw in place against a second raw in-place loop in the same "
             "alternation, the lowest and highest over the runs: the noise of the measure "
             "itself.", ""]
    for n, runs in results.items():
        lines += [f"## {n} ranks", "", "| size | in place | path | out of place | path | raw / raw |",
                  "|---|---|---|---|---|---|"]
        for i, size in enumerate(SIZES):
            ip = [r[i]["ip"] for r in runs]
            oop = [r[i]["oop"] for r in runs]
            aa = [r[i]["aa"] for r in runs]
            cell = lambda xs: ", ".join(f"**{x:.2f}**" if x < GOAL else f"{x:.2f}" for x in xs)  # noqa: E731
            paths = lambda k: ", ".join(dict.fromkeys(r[i][k] for r in runs))  # noqa: E731
            lines.append(f"| {mib(size)} | {cell(ip)} | {paths('ip_path')} | {cell(oop)} | "
                         f"{paths('oop_path')} | {min(aa):.2f}-{max(aa):.2f} |")
        worst_ip = min(r[i]["ip"] for r in runs for i in range(len(SIZES)))
        worst_oop = min(r[i]["oop"] for r in runs for i in range(len(SIZES)))
        lines += ["", f"Slowest run at any size: in place {worst_ip:.2f}, out of place {worst_oop:.2f} "
                      f"({'meets' if min(worst_ip, worst_oop) >= GOAL else 'misses'} {GOAL}).", ""]
    return "\n".join(lines) + "\n"


def report_writes(runs: list[list[dict]]) -> str:
    lines = ["## How the engine writes its slots (2 ranks, in place, shm2)", "",
             "Ours/raw with cached stores / streaming stores / chosen per call (auto), each run; "
             "round: the auto mode's fastest timed synchronisation round (median over its loops, ns): above 140 ns it "
             "streams.", "", "| size | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |",
             "|---|" + "---|" * len(runs)]
    for i, size in enumerate(WRITES_SIZES):
        cells = [f"{r[i]['cached']:.2f} / {r[i]['streaming']:.2f} / {r[i]['auto']:.2f} "
                 f"({r[i]['round_ns']:.0f} ns)" for r in runs]
        lines.append(f"| {mib(size)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4, help="fresh jobs per rank count (default 4)")
    ap.add_argument("--ranks", default="2,3", help="rank counts, comma-separated (default 2,3)")
    ap.add_argument("--no-writes", action="store_true",
                    help="skip the slot-write comparison (cached, streaming, auto; 2 ranks)")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.ranks.split(",")]
    results: dict[int, list[list[dict]]] = {n: [] for n in counts}
    writes: list[list[dict]] = []
    for run in range(args.runs):
        for n in (counts if run % 2 == 0 else counts[::-1]):
            results[n].append(one_run(n))
            print(f"bench_inplace_loop: {n} ranks, run {run + 1}/{args.runs} done", flush=True)
        if not args.no_writes:
            writes.append(one_run(2, WRITES_PROGRAM, WRITES_SIZES))
    OUT_DIR.mkdir(exist_ok=True)
    text = report(results) + ("\n" + report_writes(writes) if writes else "")
    (OUT_DIR / "inplace_loop.md").write_text(text)
    (OUT_DIR / "inplace_loop.json").write_text(json.dumps({**{str(k): v for k, v in results.items()},
                                                           "writes": writes}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
