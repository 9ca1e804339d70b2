"""What the training-step benchmarks (bench_ddp.py, bench_horovod.py) share: their timing
options, the alternating rounds inside the job, the launch of that job under dtrun, and
the step-time table they print and write."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
OUT_DIR = REPO / "bench-results"


def add_timing_args(ap: argparse.ArgumentParser, rounds: int) -> None:
    """--rounds (default ``rounds``, or BENCH_ROUNDS), --steps and --warmup."""
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("BENCH_ROUNDS", str(rounds))))
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=5)


def timing_argv(args) -> list[str]:
    """The timing options, to pass on to the job's workers."""
    return ["--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup)]


def timed_rounds(runners: dict[str, Callable[[], None]], args,
                 max_over_ranks: Callable[[float], float]) -> dict[str, list[float]]:
    """Each runner's median step time per round, the max over ranks (the slowest rank sets
    the pace). After ``args.warmup`` steps of each (allocations, plans, connections), the
    runners take turns for ``args.rounds`` rounds of ``args.steps`` steps, starting each
    round with the next one (a noisy neighbour hurts all alike), in reverse order every
    other round: rotation alone keeps the cyclic order, so one runner would always follow
    the same other one (and pay for what it leaves behind: gloo's threads, a cold cache). ``max_over_ranks(v)``: a
    collective max of v, also called before every step so that the ranks start it together."""
    modes = list(runners)
    rounds: dict[str, list[float]] = {m: [] for m in modes}
    for m in modes:
        for _ in range(args.warmup):
            runners[m]()
    for r in range(args.rounds):
        k = (r // 2) % len(modes)
        order = modes[k:] + modes[:k]
        for m in (order[::-1] if r % 2 else order):
            times = []
            for _ in range(args.steps):
                max_over_ranks(0.0)  # start every step together
                t0 = time.perf_counter()
                runners[m]()
                times.append(time.perf_counter() - t0)
            rounds[m].append(max_over_ranks(statistics.median(times)))
    return rounds


def run_bench_job(prog: str, dtrun_args: list[str], script_args: list[str], timeout: int) -> dict:
    """Run ``dtrun DTRUN_ARGS python SCRIPT_ARGS`` from the repository and return the JSON of
    its ``BENCH {...}`` line; exit naming ``prog`` and the command when it fails."""
    cmd = [str(BIN / "dtrun"), *dtrun_args, sys.executable, *script_args]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
                          stdin=subprocess.DEVNULL)
    line = next((ln for ln in proc.stdout.splitlines() if "BENCH {" in ln), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{prog}: {' '.join(cmd)} failed ({proc.returncode}):\n"
                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[line.index("{"):])


def write_table(name: str, head: str, rows: list[tuple[str, str, str]], doc: dict) -> None:
    """Print ``head`` and a table of (variant, step in ms, note) rows; write the same text
    to bench-results/NAME.md and ``doc`` to NAME.json."""
    table = ["| variant | step (ms) | |", "|---|---:|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = head + "\n\n" + "\n".join(table) + "\n"
    print(text)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / f"{name}.md").write_text(text)
    (OUT_DIR / f"{name}.json").write_text(json.dumps(doc, indent=1))
