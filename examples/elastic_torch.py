"""Elastic training with Horovod's API: the job goes on from its last in-memory commit
when a host is lost, and grows when the discovery script lists more hosts.

A Horovod script, unchanged under ``dtrun --horovod``: a small linear model trained with
``hvd.DistributedOptimizer`` on synthetic data. Each step every rank takes its share of a
global batch that is the same for any number of ranks, so the weights do not depend on
how many ranks there were or when the job changed. ``state.commit()`` every ``--commit-every``
steps; no checkpoint file, no shared directory.

    dtrun --horovod -H h1:1,h2:1,h3:1,h4:1 -np 3 --max-restarts 2 python examples/elastic_torch.py
    dtrun --horovod --host-discovery-script ./discover.sh --min-np 2 --max-np 4 python examples/elastic_torch.py

``--crash-at N``: rank ``--crash-rank`` exits (code 9) after step N, in the first attempt only.
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import torch

import horovod.torch as hvd

FEATURES, BATCH = 8, 48


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same rows whatever the number of ranks."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)
    true_w = torch.arange(1, FEATURES + 1, dtype=torch.float64) / FEATURES
    return x, x @ true_w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--commit-every", type=int, default=2)
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds each step takes at least")
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--crash-rank", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)

    hvd.init()
    model = torch.nn.Linear(FEATURES, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        if hvd.rank() == 0:
            print(f"start at step {state.step}: {hvd.size()} ranks", flush=True)
        while state.step < args.steps:
            t0 = time.monotonic()
            x, y = batch(state.step)
            n, r = hvd.size(), hvd.rank()
            lo, hi = r * BATCH // n, (r + 1) * BATCH // n
            opt.zero_grad()
            loss = ((model(x[lo:hi]).squeeze(1) - y[lo:hi]) ** 2).sum() / BATCH
            loss.backward()
            opt.step()
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()
            if r == 0:
                print(f"step {state.step} ranks {n}", flush=True)
            if state.step == args.crash_at and r == args.crash_rank and os.environ.get("DTRUN_RESTART_COUNT") == "0":
                os._exit(9)
            time.sleep(max(0.0, args.step_time - (time.monotonic() - t0)))

    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    train(state)
    w = " ".join(f"{v:.12f}" for v in model.weight.detach().flatten().tolist())
    print(f"rank {hvd.rank()} of {hvd.size()} on {socket.gethostname()} final w {w}", flush=True)


if __name__ == "__main__":
    main()
