"""How much dtrun adds to a bare mpirun, and how fast its CLI answers.

Runs `dtrun -np 2 -H localhost:2 python -c "from mpi4py import MPI"` and the same
job through bare mpirun with the same flags (the command dtrun builds, without its
rank wrapper), alternating, as pairs in one run; reports the median of the
differences and of the ratios. Also times `dtrun --help` and `dtrun --dry-run`.
Writes bench-results/launch.md and launch.json.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.dtrun_helpers import BIN, DTRUN, user_env as env  # noqa: E402  (the same environment the tests use)
PROG = ["python", "-c", "from mpi4py import MPI"]
PAIRS = int(os.environ.get("BENCH_PAIRS", "15"))
TARGET_ADDED_S = 0.15
TARGET_DRY_RUN_S = 0.2



def timed(argv) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env(), cwd=REPO, timeout=120)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed: {p.stderr.decode()[-500:]}")
    return dt


def bare_mpirun_argv() -> list[str]:
    from dtrun.launcher.command import build_command
    from dtrun.launcher.hosts import HostOptions
    from dtrun.launcher.launch import LaunchOptions, prepare

    opts = LaunchOptions(program=tuple(PROG), np=2, hosts=HostOptions(host_list="localhost:2"),
                         rank_wrapper=False)
    prepared = prepare(opts, environ=env())  # resolve `python` as the dtrun runs do
    flavor, spec = prepared.flavor, prepared.spec
    return build_command(spec, flavor)


def main() -> int:
    out_dir = REPO / "bench-results"
    out_dir.mkdir(exist_ok=True)
    dtrun_argv = [DTRUN, "-np", "2", "-H", "localhost:2", *PROG]
    bare = bare_mpirun_argv()
    timed(dtrun_argv), timed(bare)  # warm caches (flavor cache, page cache)
    pairs = []
    for i in range(PAIRS):
        order = [("dtrun", dtrun_argv), ("bare", bare)] if i % 2 == 0 else [("bare", bare), ("dtrun", dtrun_argv)]
        t = {name: timed(argv) for name, argv in order}
        pairs.append((t["dtrun"], t["bare"]))
    diffs = [d - b for d, b in pairs]
    ratios = [d / b for d, b in pairs]
    helps = [timed([DTRUN, "--help"]) for _ in range(10)]
    dry = [timed([DTRUN, "--dry-run", "-np", "2", "-H", "localhost:2", *PROG]) for _ in range(10)]
    res = {
        "pairs": PAIRS,
        "dtrun_median_s": statistics.median(d for d, _ in pairs),
        "bare_mpirun_median_s": statistics.median(b for _, b in pairs),
        "added_median_s": statistics.median(diffs),
        "ratio_median": statistics.median(ratios),
        "help_median_s": statistics.median(helps),
        "dry_run_median_s": statistics.median(dry),
        "bare_command": bare,
    }
    res["added_target_met"] = res["added_median_s"] <= TARGET_ADDED_S
    res["dry_run_target_met"] = res["dry_run_median_s"] < TARGET_DRY_RUN_S
    (out_dir / "launch.json").write_text(json.dumps(res, indent=2))
    md = [
        "| measure | median | target |",
        "|---|---|---|",
        f"| dtrun job (2 ranks, localhost) | {res['dtrun_median_s']:.3f} s | |",
        f"| bare mpirun, same flags | {res['bare_mpirun_median_s']:.3f} s | |",
        f"| added by dtrun (paired difference) | {res['added_median_s']:.3f} s | ≤ {TARGET_ADDED_S} s {'✓' if res['added_target_met'] else '✗'} |",
        f"| dtrun / bare (paired ratio) | {res['ratio_median']:.2f}× | |",
        f"| `dtrun --help` | {res['help_median_s']:.3f} s | |",
        f"| `dtrun --dry-run …` | {res['dry_run_median_s']:.3f} s | < {TARGET_DRY_RUN_S} s {'✓' if res['dry_run_target_met'] else '✗'} |",
    ]
    (out_dir / "launch.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
