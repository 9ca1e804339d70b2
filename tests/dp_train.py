"""Training runs for tests/test_dp.py: run under ``dtrun -np N`` (or alone for 1 rank).

For each model (an MLP and a small CNN), optimizer (SGD with momentum, Adam) and
accumulation (1 or 2 backward passes per step) it trains 20 steps twice:

* the reference: plain PyTorch on the whole batch B, computed locally on every rank;
* data-parallel: ``collectives.dp`` with each rank taking its B/N rows of the same
  batch (split further into micro-batches when accumulating).

Each rank saves both results to OUT/rank.R.npz; the test compares them.
Usage: python tests/dp_train.py OUT [--device cpu|cuda] [--compression none|fp16]
       [--bucket-bytes N]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

import dtrun.collectives.dp as dp

STEPS, BATCH = 20, 48  # 48: 1, 2, 3 or 4 ranks, each split in 2 micro-batches


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def cnn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.MaxPool2d(2), torch.nn.Conv2d(4, 6, 3), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(6 * 2 * 2, 4))


MODELS = {"mlp": (mlp, (12,)), "cnn": (cnn, (1, 8, 8))}
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def data(shape, device):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn((STEPS, BATCH) + shape, generator=g)
    y = torch.randint(0, 4, (STEPS, BATCH), generator=g)
    return x.to(device), y.to(device)


def reference(model_name, opt_name, device):
    build, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = build().to(device)
    opt = OPTIMIZERS[opt_name](model.parameters())
    x, y = data(shape, device)
    for step in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[step]), y[step]).backward()
        opt.step()
    return model


TRANSPORTS: set[str] = set()  # how the buckets travelled (DistributedOptimizer.transport)


def distributed(model_name, opt_name, accum, device, compression, bucket_bytes):
    build, shape = MODELS[model_name]
    torch.manual_seed(100 + dp.rank())  # different on every rank: broadcast must fix it
    model = build().to(device)
    # rank 0 takes the reference initialisation; the others get it by broadcast
    if dp.rank() == 0:
        torch.manual_seed(0)
        model.load_state_dict(build().to(device).state_dict())
    dp.broadcast_parameters(model, root=0)
    opt = OPTIMIZERS[opt_name](model.parameters())
    opt = dp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  backward_passes_per_step=accum, compression=compression,
                                  bucket_bytes=bucket_bytes)
    TRANSPORTS.add(opt.transport)
    x, y = data(shape, device)
    per_rank = BATCH // dp.size()
    lo = dp.rank() * per_rank
    micro = per_rank // accum
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(accum):
            a, b = lo + m * micro, lo + (m + 1) * micro
            loss = torch.nn.functional.cross_entropy(model(x[step, a:b]), y[step, a:b])
            (loss / accum).backward()
        opt.step()
    opt.remove_hooks()
    return model


def flat(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).numpy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compression", default="none")
    ap.add_argument("--bucket-bytes", type=int, default=dp.DEFAULT_BUCKET_BYTES)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = dp.init()
    device = ctx.device if args.device == "cuda" else torch.device("cpu")
    results = {}
    for model_name in MODELS:
        for opt_name in OPTIMIZERS:
            ref = flat(reference(model_name, opt_name, device))
            for accum in (1, 2):
                key = f"{model_name}-{opt_name}-accum{accum}"
                results[f"{key}-ref"] = ref
                results[f"{key}-dist"] = flat(distributed(model_name, opt_name, accum, device,
                                                          args.compression, args.bucket_bytes))
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"rank.{ctx.rank}.npz"), size=ctx.size,
             transports=",".join(sorted(TRANSPORTS)), **results)
    print(f"rank {ctx.rank}/{ctx.size} done", flush=True)


if __name__ == "__main__":
    main()
