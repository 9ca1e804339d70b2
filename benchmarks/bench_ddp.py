"""`make bench` driver: collectives.dp's DistributedOptimizer against PyTorch DDP (gloo).

Same model, same per-rank batch, 2 ranks on localhost, in the same processes: the job
is launched by dtrun, torch.distributed meets through the env:// variables dtrun
exports (MASTER_ADDR/MASTER_PORT), and collectives.dp runs on the bundled MPI runtime
beside it. Inside the job the variants take turns, round after round (so a noisy
neighbour hurts all of them alike), and each round records the median step time
(zero_grad, forward, backward, optimizer step) of every variant:

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with the gloo backend;
* ``dp``: ``collectives.dp.DistributedOptimizer`` (allreduce overlapped with backward);
* ``dp-after``: the same with ``overlap=False`` (every bucket reduced after backward),
  which gives the time overlap saves;
* ``local`` (a separate 1-rank job): no communication, for the scaling efficiency
  1 -> 2 ranks (weak scaling: step time on 1 rank / step time on 2 ranks).

Writes bench-results/ddp.md and ddp.json and prints the table. Figures are medians
over all rounds. The exit code is 0 unless a run fails: a missed goal (dp/ddp speed
ratio >= 1.0) is a finding to report, not a crash.

    python benchmarks/bench_ddp.py [--rounds N] [--steps N] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import add_timing_args, run_bench_job, timed_rounds, timing_argv, write_table  # noqa: E402

WIDTH, DEPTH = 1024, 4  # MLP 256 -> 4 x 1024 -> 10: about 3.4 M parameters
BATCH = int(os.environ.get("BENCH_BATCH", "32"))  # per rank
BUCKET_BYTES = int(float(os.environ.get("BENCH_BUCKET_MB", "4")) * 2**20)


def build_model():
    import torch

    layers, width_in = [], 256
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(width_in, WIDTH), torch.nn.ReLU()]
        width_in = WIDTH
    layers.append(torch.nn.Linear(width_in, 10))
    return torch.nn.Sequential(*layers)


def batch(rank: int):
    """This rank's inputs and labels (a generator seeded by the rank)."""
    import torch

    g = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, 256, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def fresh_model():
    """The MLP, with the same initial weights on every rank, and SGD with momentum over it."""
    import torch

    torch.manual_seed(0)
    model = build_model()
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def make_step(model, opt, x, y):
    """One timed step: zero_grad, forward, backward, optimizer step."""
    import torch.nn.functional as F

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


# ----------------------------------------------------------------------------- in the job
def worker(args) -> None:
    import torch

    import dtrun.collectives.dp as dp

    torch.set_num_threads(1)  # 2 ranks on 2 cores: one compute thread each
    ctx = dp.init()
    modes = args.modes.split(",")
    if "ddp" in modes:
        import torch.distributed as dist
        from datetime import timedelta

        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    x, y = batch(ctx.rank)
    runners = {}
    for mode in modes:
        model, opt = fresh_model()
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif mode in ("dp", "dp-after"):
            opt = dp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                          overlap=mode == "dp", bucket_bytes=BUCKET_BYTES)
        runners[mode] = make_step(model, opt, x, y)
    rounds = timed_rounds(runners, args, lambda v: dp.allreduce_metric(v, op="max"))
    if ctx.rank == 0:
        nparams = sum(p.numel() for p in build_model().parameters())
        print("BENCH " + json.dumps({"size": ctx.size, "params": nparams, "rounds": rounds}),
              flush=True)
    if "ddp" in modes:
        import gc

        runners.clear()  # the DDP model holds the process group
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()  # see tests/torchdist_env.py: gloo's teardown at interpreter exit


# ----------------------------------------------------------------------------- the driver
def run_job(n: int, modes: str, args) -> dict:
    return run_bench_job("bench_ddp", ["-np", str(n), "-H", f"localhost:{n}"],
                         [str(Path(__file__).resolve()), "--worker", "--modes", modes,
                          *timing_argv(args)], timeout=900)


def main() -> int:
    ap = argparse.ArgumentParser(description="DistributedOptimizer vs DDP/gloo, 2 ranks")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="ddp,dp,dp-after", help=argparse.SUPPRESS)
    add_timing_args(ap, rounds=5)
    ap.add_argument("--jobs", type=int, default=2, help="pairs of (1-rank, 2-rank) jobs")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    per_mode: dict[str, list[float]] = {}
    params = 0
    for _ in range(args.jobs):  # alternate the 1-rank and 2-rank jobs too
        for n, modes in ((1, "local"), (2, "ddp,dp,dp-after")):
            doc = run_job(n, modes, args)
            params = doc["params"]
            for m, vals in doc["rounds"].items():
                per_mode.setdefault(m, []).extend(vals)
    med = {m: statistics.median(v) for m, v in per_mode.items()}
    ms = lambda s: f"{1000 * s:.1f}"  # noqa: E731
    rows = [
        ("torch DDP, gloo (2 ranks)", ms(med["ddp"]), ""),
        ("dtrun.collectives.dp DistributedOptimizer (2 ranks)", ms(med["dp"]),
         f"{med['ddp'] / med['dp']:.2f}x DDP's speed"),
        ("dtrun.collectives.dp, allreduce after backward (2 ranks)", ms(med["dp-after"]),
         f"overlap saves {ms(med['dp-after'] - med['dp'])} ms per step"),
        ("1 rank, no communication", ms(med["local"]),
         f"scaling efficiency 1->2 ranks: dp {med['local'] / med['dp']:.0%}, "
         f"DDP {med['local'] / med['ddp']:.0%}"),
    ]
    head = (f"MLP 256-{'-'.join([str(WIDTH)] * DEPTH)}-10 ({params / 1e6:.1f} M parameters, "
            f"{4 * params / 2**20:.0f} MiB of float32 gradients), batch {BATCH} per rank, SGD "
            f"with momentum, 1 compute thread per rank; median step time over "
            f"{len(per_mode['dp'])} rounds of {args.steps} steps")
    write_table("ddp", head, rows, {"median_s": med, "rounds": per_mode, "params": params})
    ratio = med["ddp"] / med["dp"]
    print(f"goal dp/DDP speed >= 1.0: {'met' if ratio >= 1.0 else 'MISSED'} ({ratio:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
