"""Behaviours of collectives.dp that tests/test_dp.py checks from outside, one per mode.

Usage: python tests/dp_cases.py MODE   (under ``dtrun -np N``; prints ``RESULT {json}``)

Modes:
  before-init   call broadcast_parameters without init() (must raise NotInitializedError)
  mismatch      rank 1 builds a wider hidden layer (every rank must raise, naming it)
  unused        rank 1 skips a branch of the model: no hang; a branch no rank used keeps
                grad None; the averaged gradient counts rank 1's zeros
  clip          synchronize(), clip, step() under skip_synchronize()
  api           broadcast_object, allreduce_metric, shard
  two           two DistributedOptimizers whose buckets are ready in the same backward
                pass; the average must equal a reference computed from all ranks' data
  step-each     step() a bucket at a time against the whole step (forced by a step hook):
                the same bits for several optimizers, with a parameter in no bucket and a
                sparse gradient gathered; and how often the optimizer's own step ran
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

import dtrun.collectives.dp as dp


def report(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


class TwoBranch(torch.nn.Module):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.a = torch.nn.Linear(4, hidden)
        self.b = torch.nn.Linear(4, hidden)
        self.never = torch.nn.Linear(4, hidden)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x, use_b: bool):
        h = self.a(x) + (self.b(x) if use_b else 0)
        return self.head(torch.tanh(h))


class Frozen(torch.nn.Module):
    """Three layers, a sparse embedding, and a parameter outside autograd whose gradient
    the script sets by hand (it is in no bucket: only the optimizer steps it)."""

    def __init__(self, sparse: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8, sparse=sparse)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 4))
        self.frozen = torch.nn.Parameter(torch.ones(5), requires_grad=False)

    def forward(self, idx):
        return self.body(self.emb(idx))


STEP_EACH = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "sgd-sparse": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adam-groups": lambda ps: torch.optim.Adam(ps, lr=0.01),  # given groups, below
}


def _train_step_each(ctx, name: str, whole: bool) -> tuple[torch.Tensor, list[int]]:
    sparse = name.endswith("-sparse")
    torch.manual_seed(1)
    model = Frozen(sparse)
    calls: list[int] = []
    params = model.parameters()
    if name == "adam-groups":  # a bucket's parameters in two groups, another group in none
        body = list(model.body.parameters())
        params = [{"params": body[:4]}, {"params": body[4:], "lr": 0.03},
                  {"params": [model.emb.weight, model.frozen], "lr": 0.02}]
    opt = dp.DistributedOptimizer(STEP_EACH[name](params),
                                  named_parameters=model.named_parameters(),
                                  bucket_bytes=4096, sparse_as_dense=not sparse)
    if whole:
        opt.register_step_post_hook(lambda *_: None)
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(4):
        opt.zero_grad()
        model.frozen.grad = torch.full((5,), 0.5 + ctx.rank)
        model(torch.randint(0, 10, (16,), generator=gen)).pow(2).mean().backward()
        before = len(_STEP_CALLS)
        opt.step()
        calls.append(len(_STEP_CALLS) - before)
    opt.remove_hooks()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, calls


_STEP_CALLS: list[int] = []


def step_each(ctx) -> None:
    plain = torch.optim.SGD.step  # counted: how often SGD's own step ran per step()

    def counting(self, *a, **k):
        _STEP_CALLS.append(1)
        return plain(self, *a, **k)

    torch.optim.SGD.step = counting
    exact, calls = {}, {}
    for name in STEP_EACH:
        each, n_each = _train_step_each(ctx, name, whole=False)
        whole, n_whole = _train_step_each(ctx, name, whole=True)
        exact[name] = each.numpy().tobytes() == whole.numpy().tobytes()
        if name.startswith("sgd"):
            calls[name] = {"each": n_each, "whole": n_whole}
    probe = dp.DistributedOptimizer(torch.optim.SGD(Frozen(False).parameters(), lr=0.1),
                                    bucket_bytes=4096)
    report(rank=ctx.rank, exact=exact, calls=calls, buckets=len(probe._dp_buckets),
           failed_step=_failed_step(ctx, counting))


def _failed_step(ctx, counting) -> dict:
    """The optimizer's own step raises on the first bucket while the last bucket's
    allreduce is still running (made slow): step() raises only once that bucket is done,
    and the steps after it train on, the same on every rank."""
    torch.manual_seed(1)
    model = Frozen(False)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), bucket_bytes=4096)
    comm, real = ctx.comm, ctx.comm.allreduce
    state = {"slow": False, "done": 0}

    def allreduce(x, *a, **k):  # the last bucket: the first layer and the embedding
        out = real(x, *a, **k)
        if state["slow"] and x.size < 2000:
            time.sleep(0.5)
            state["done"] += 1
        return out

    def boom(self, *a, **k):
        raise RuntimeError("boom")

    comm.allreduce = allreduce
    gen = torch.Generator().manual_seed(ctx.rank)
    seen = {}
    try:
        for i in range(3):
            opt.zero_grad()
            state["slow"] = i == 1
            model(torch.randint(0, 10, (16,), generator=gen)).pow(2).mean().backward()
            torch.optim.SGD.step = boom if i == 1 else counting
            try:
                opt.step()
            except RuntimeError as e:
                seen = {"error": str(e), "slow_bucket_done": state["done"]}
    finally:
        comm.allreduce = real
        torch.optim.SGD.step = counting
        opt.remove_hooks()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    seen["same_everywhere"] = len(set(ctx.comm.mpi.allgather(flat.numpy().tobytes()))) == 1
    return seen


def main(mode: str) -> None:
    torch.manual_seed(0)
    if mode == "before-init":
        try:
            dp.broadcast_parameters(torch.nn.Linear(2, 2))
        except dp.NotInitializedError as e:
            report(error=str(e))
        return
    ctx = dp.init()
    if mode == "step-each":
        step_each(ctx)
        return
    if mode == "mismatch":
        model = TwoBranch(hidden=16 if ctx.rank == 1 else 8)
        try:
            dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters())
        except dp.ParameterMismatchError as e:
            report(rank=ctx.rank, error=str(e))
        return
    if mode == "unused":
        model = TwoBranch()
        dp.broadcast_parameters(model)
        opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      bucket_bytes=64)  # one bucket per parameter or so
        x = torch.ones(2, 4)
        for _ in range(3):  # several steps: the buckets must come back in step
            opt.zero_grad()
            model(x, use_b=ctx.rank != 1).sum().backward()
            local_b = None if model.b.weight.grad is None else model.b.weight.grad.clone()
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        report(rank=ctx.rank, never_grad_none=model.never.weight.grad is None,
               b_grad=float(model.b.weight.grad.sum()),
               b_local=None if local_b is None else float(local_b.sum()),
               checksum=float(sum(p.detach().double().sum() for p in model.parameters())))
        return
    if mode == "clip":
        model = TwoBranch()
        dp.broadcast_parameters(model)
        opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
        x = torch.full((2, 4), float(ctx.rank + 1))
        opt.zero_grad()
        (model(x, use_b=True).sum() * 100).backward()
        opt.synchronize()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        total = float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()
                                     if p.grad is not None)))
        with opt.skip_synchronize():
            opt.step()
        try:  # a second backward without step() is a usage error, said clearly
            opt.zero_grad()
            model(x, use_b=True).sum().backward()
            model(x, use_b=True).sum().backward()
            err = None
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            err = str(e)
        report(rank=ctx.rank, norm_before=norm, norm_after=total, double_backward=err)
        return
    if mode == "api":
        obj = dp.broadcast_object({"epoch": 7, "rank": ctx.rank} if ctx.rank == 0 else None)
        metric = dp.allreduce_metric(float(ctx.rank))
        tmetric = dp.allreduce_metric(torch.tensor([ctx.rank, 1.0]), op="sum").tolist()
        parts = [dp.shard(10, seed=3).tolist() for _ in range(2)]
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        if ctx.rank == 0:  # only root has optimizer state, and another lr
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            opt.param_groups[0]["lr"] = 0.5
        dp.broadcast_optimizer_state(opt)
        st = opt.state_dict()
        report(rank=ctx.rank, obj=obj, metric=metric, tmetric=tmetric, shard=parts[0],
               shard_again=parts[1], lr=st["param_groups"][0]["lr"],
               step=float(st["state"][0]["step"]) if st["state"] else None,
               is_adam=isinstance(dp.DistributedOptimizer(opt), torch.optim.Adam))
        return
    if mode == "two":
        torch.manual_seed(0)
        model = TwoBranch()
        ref = TwoBranch()
        ref.load_state_dict(model.state_dict())
        first = [model.a.weight, model.a.bias]
        rest = [p for n, p in model.named_parameters() if not n.startswith("a.")]
        named = dict(model.named_parameters())
        opts = [dp.DistributedOptimizer(torch.optim.SGD(ps, lr=0.1), bucket_bytes=64,
                                        named_parameters=[(n, p) for n, p in named.items()
                                                          if any(p is q for q in ps)])
                for ps in (first, rest)]
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(r)) for r in range(ctx.size)]
        for _ in range(3):
            for o in opts:
                o.zero_grad()
            model(xs[ctx.rank], use_b=True).sum().backward()
            for o in opts:
                o.step()
            ref_opt.zero_grad()  # the same step on every rank's data at once
            (sum(ref(x, use_b=True).sum() for x in xs) / ctx.size).backward()
            ref_opt.step()
        diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
        report(rank=ctx.rank, diff=diff,
               checksum=float(sum(p.detach().double().sum() for p in model.parameters())))
        return
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    np.seterr(all="raise")
    main(sys.argv[1])
