"""`make bench` driver for the collectives runtime: 2 ranks on localhost vs raw mpi4py.

Runs ``python -m collectives.bench`` under dtrun (mpirun if dtrun is not installed)
and checks the four performance targets:

1. allreduce busbw >= 0.95x raw mpi4py for every size from 1 MiB to 64 MiB;
2. per-call overhead over raw mpi4py at 8 bytes <= 5 us;
3. grouped_allreduce of 256 x 4 KiB >= 5x faster than 256 separate allreduces;
4. allreduce busbw at 16 MiB (shared-memory path) >= 1.5x raw mpi4py.

Ours and raw are timed alternately in several rounds and each keeps its best round
(see collectives/bench.py), because this host is shared and single timings vary a
lot. Ratios use the out-of-place columns (nccl-tests' primary numbers); in-place
figures are reported beside them. Writes bench-results/collectives.md and .json and
prints whether each target is met. Exit code 0 unless a run fails or a value is wrong:
a missed target is a finding to report, not a crash.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench-results"
BIN = Path(sys.executable).parent
NRANKS = 2
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))


def launcher() -> list[str]:
    dtrun = BIN / "dtrun"
    if dtrun.exists():
        return [str(dtrun), "-np", str(NRANKS), "-H", f"localhost:{NRANKS}", "--oversubscribe"]
    mpirun = shutil.which("mpirun", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *extra, "--bind-to", "none", "-np", str(NRANKS)]


def bench(*args: str, env: dict | None = None) -> dict:
    cmd = launcher() + [sys.executable, "-m", "collectives.bench", "--json", *args]
    full_env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    full_env.update(env or {})
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO,
                          env=full_env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        sys.exit(f"bench_collectives: {' '.join(cmd)} failed ({proc.returncode}):\n"
                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    doc = json.loads(proc.stdout[proc.stdout.index("{"):])
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    doc["command"] = " ".join(cmd[len(launcher()):])
    return doc


def mib(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 1024:g} KiB" if n >= 1024 else f"{n} B"


def main() -> int:
    load_before = os.getloadavg()
    sweep = bench("-o", "allreduce", "-b", "1M", "-e", "64M", "-f", "2", "-n", "20", "-w", "5",
                  "--baseline", "--rounds", str(ROUNDS))
    noshm = bench("-o", "allreduce", "-b", "16M", "-e", "16M", "-n", "20", "-w", "5",
                  "--baseline", "--rounds", str(ROUNDS), env={"DTRUN_SHM": "0"})
    tiny = bench("-o", "allreduce", "-b", "8", "-e", "8", "-n", "20000", "-w", "2000",
                 "--baseline", "--rounds", str(ROUNDS))
    fused = bench("-o", "grouped", "-b", "4K", "-e", "4K", "--tensors", "256", "-n", "20",
                  "-w", "5", "--rounds", str(ROUNDS))
    load_after = os.getloadavg()

    rows = sweep["rows"]
    min_ratio = min(r["oop_ratio"] for r in rows)
    worst = min(rows, key=lambda r: r["oop_ratio"])
    at16 = next(r for r in rows if r["size"] == 16 * 2**20)
    t8 = tiny["rows"][0]
    overhead_oop = t8["oop_time_us"] - t8["raw_oop_time_us"]
    overhead_ip = t8["ip_time_us"] - t8["raw_ip_time_us"]
    speedup = fused["rows"][0]["speedup"]
    targets = [
        {"target": "allreduce busbw vs raw mpi4py, 1-64 MiB (min over sizes)",
         "measured": min_ratio, "goal": ">= 0.95x", "met": min_ratio >= 0.95,
         "note": f"worst at {mib(worst['size'])}"},
        {"target": "per-call overhead over raw mpi4py at 8 bytes (out-of-place)",
         "measured": overhead_oop, "goal": "<= 5 us", "met": overhead_oop <= 5.0,
         "note": f"in-place {overhead_ip:.2f} us; raw {t8['raw_oop_time_us']:.2f} us, "
                 f"ours {t8['oop_time_us']:.2f} us"},
        {"target": "grouped_allreduce 256 x 4 KiB vs 256 separate allreduces",
         "measured": speedup, "goal": ">= 5x", "met": speedup >= 5.0,
         "note": f"fused {fused['rows'][0]['fused_time_us']:.0f} us, separate "
                 f"{fused['rows'][0]['separate_time_us']:.0f} us"},
        {"target": "shared-memory allreduce busbw at 16 MiB vs raw mpi4py",
         "measured": at16["oop_ratio"], "goal": ">= 1.5x", "met": at16["oop_ratio"] >= 1.5,
         "note": f"in-place {at16['ip_ratio']:.2f}x; ours {at16['oop_busbw']:.2f} GB/s, raw "
                 f"{at16['raw_oop_busbw']:.2f} GB/s"},
    ]
    wrong = sweep["wrong"] + noshm["wrong"] + tiny["wrong"] + fused["wrong"]

    lines = [
        "# Collectives benchmark (2 ranks, localhost)", "",
        f"Host: {os.cpu_count()} cores; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after (a shared host: timings vary between runs). "
        f"Ours and raw mpi4py timed alternately, best of {ROUNDS} rounds each; "
        "busbw = algbw x 2(n-1)/n.", "",
        "## Targets", "",
        "| target | measured | goal | met |", "|---|---|---|---|",
    ]
    for t in targets:
        unit = " us" if "overhead" in t["target"] else "x"
        lines.append(f"| {t['target']} ({t['note']}) | {t['measured']:.2f}{unit} | {t['goal']} | "
                     f"{'yes' if t['met'] else '**no**'} |")
    lines += ["", "## allreduce float32 sum: ours vs raw mpi4py", "",
              "| size | ours busbw (GB/s) | raw busbw | ratio | ours in-place | raw in-place | "
              "ratio in-place | path | #wrong |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {mib(r['size'])} | {r['oop_busbw']:.2f} | {r['raw_oop_busbw']:.2f} | "
                     f"{r['oop_ratio']:.2f} | {r['ip_busbw']:.2f} | {r['raw_ip_busbw']:.2f} | "
                     f"{r['ip_ratio']:.2f} | shm | {r['oop_wrong'] + r['ip_wrong']} |")
    n16 = noshm["rows"][0]
    lines += ["", f"Without the shared-memory path (DTRUN_SHM=0) at 16 MiB: ours "
              f"{n16['oop_busbw']:.2f} GB/s vs raw {n16['raw_oop_busbw']:.2f} GB/s "
              f"(ratio {n16['oop_ratio']:.2f}): the wrapper itself costs nothing measurable; the "
              "gain comes from the shared-memory algorithm.", "",
              f"8-byte allreduce: ours {t8['oop_time_us']:.2f} us, raw {t8['raw_oop_time_us']:.2f} us "
              f"(in place: {t8['ip_time_us']:.2f} vs {t8['raw_ip_time_us']:.2f} us).", "",
              "Commands (each under `dtrun -np 2 -H localhost:2 --oversubscribe`):", ""]
    for doc in (sweep, noshm, tiny, fused):
        lines.append(f"- `{doc['command']}` ({doc['wall_s']} s)")
    lines.append("")
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "collectives.md").write_text("\n".join(lines))
    (OUT_DIR / "collectives.json").write_text(json.dumps(
        {"targets": targets, "allreduce_sweep": sweep, "allreduce_16MiB_no_shm": noshm,
         "allreduce_8B": tiny, "grouped_256x4KiB": fused,
         "loadavg_before": load_before, "loadavg_after": load_after}, indent=1))
    print("\n".join(lines))
    for t in targets:
        print(f"{'MET ' if t['met'] else 'MISSED'}  {t['target']}: {t['measured']:.2f} "
              f"(goal {t['goal']})")
    print(f"wrote {OUT_DIR / 'collectives.md'} and {OUT_DIR / 'collectives.json'}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
