"""Rank program for tests/test_horovod_torch.py: run under ``dtrun -np N``.

Written as a Horovod user writes one (``import dtrun.collectives.horovod.torch as hvd``; the
rest is Horovod's API). Every rank checks, against NumPy on data every rank can compute:

* every collective and its ``_async`` form, for each dtype Horovod's torch ops take;
* matching by name (ranks submit in different orders), the mismatched-shape error,
  ``join``, the object collectives, the unsupported API (elastic);
* training: N ranks x B/N rows with ``SyncBatchNorm`` and ``DistributedOptimizer`` against
  one process with ``BatchNorm`` on all B rows (the reference, computed on every rank);
* ``gradient_predivide_factor`` with fp16 compression (a sum that overflows float16).

Each rank prints one line ``RESULT {json}``; ``OUT/rank.R.npz`` holds the trained weights.
Usage: python tests/horovod_torch_cases.py OUT
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

import dtrun.collectives.horovod.torch as hvd
import horovod_common as common  # tests/, this script's folder

hvd.init()
R, N = hvd.rank(), hvd.size()
failures: list[str] = []
checked = 0

DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
          "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64}


def data(r: int, dtype: str, rows: int = 4) -> np.ndarray:
    return common.data(r, rows)


def tensor(values: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(values.copy()).to(DTYPES[dtype])


def check(what: str, got, want: np.ndarray, dtype: str) -> None:
    global checked
    checked += 1
    got = got.to(torch.float64).numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    common.compare(failures, what, got, want, dtype)


def reduce(op, dtype):
    return common.reduced(op, dtype, N)


def collectives() -> None:
    for dtype in DTYPES:
        x = data(R, dtype)
        for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
            want = reduce(op, dtype)
            t = tensor(x, dtype)
            check(f"allreduce {op}", hvd.allreduce(t, op=op), want, dtype)
            check(f"allreduce input kept {op}", t, x, dtype)
            check(f"allreduce_async {op}", hvd.synchronize(hvd.allreduce_async(t, op=op)),
                  want, dtype)
            t2 = tensor(x, dtype)
            out = hvd.allreduce_(t2, op=op)
            check(f"allreduce_ {op}", t2, want, dtype)
            assert out is t2
            t3 = tensor(x, dtype)
            h = hvd.allreduce_async_(t3, op=op, name=f"inplace.{dtype}.{op}")
            while not hvd.poll(h):
                pass
            check(f"allreduce_async_ {op}", hvd.synchronize(h), want, dtype)
            check(f"allreduce_async_ in place {op}", t3, want, dtype)
            pair = [tensor(x, dtype), tensor(x[:2] * 1, dtype)]
            for name, outs in [
                ("grouped_allreduce", hvd.grouped_allreduce(pair, op=op)),
                ("grouped_allreduce_async",
                 hvd.synchronize(hvd.grouped_allreduce_async(pair, op=op)))]:
                check(f"{name} {op} [0]", outs[0], want, dtype)
                check(f"{name} {op} [1]", outs[1], reduce_rows(op, dtype, 2), dtype)
            check(f"grouped input kept {op}", pair[0], x, dtype)
            hvd.grouped_allreduce_(pair, op=op)
            check(f"grouped_allreduce_ {op}", pair[0], want, dtype)
            if op not in (hvd.Average, hvd.Sum):  # Horovod's reducescatter takes these two
                try:
                    hvd.reducescatter(tensor(x, dtype), op=op)
                    failures.append(f"reducescatter {op} {dtype}: no error")
                except RuntimeError:
                    pass
                continue
            want_rs = reduce(op, dtype)
            rows = [len(a) for a in np.array_split(np.arange(want_rs.shape[0]), N)]
            start = sum(rows[:R])
            check(f"reducescatter {op}", hvd.reducescatter(tensor(x, dtype), op=op),
                  want_rs[start:start + rows[R]], dtype)
            check(f"reducescatter_async {op}", hvd.synchronize(
                hvd.reducescatter_async(tensor(x, dtype), op=op)),
                want_rs[start:start + rows[R]], dtype)
        # allreduce default op is Average
        check("allreduce default op", hvd.allreduce(tensor(x, dtype)),
              reduce(hvd.Average, dtype), dtype)
        # allgather: rank r contributes r + 1 rows
        mine = data(R, dtype, rows=R + 1)
        want = np.concatenate([data(r, dtype, rows=r + 1) for r in range(N)])
        check("allgather", hvd.allgather(tensor(mine, dtype)), want, dtype)
        check("allgather_async", hvd.synchronize(hvd.allgather_async(tensor(mine, dtype))),
              want, dtype)
        # broadcast from the last rank
        root = N - 1
        check("broadcast", hvd.broadcast(tensor(x, dtype), root), data(root, dtype), dtype)
        check("broadcast_async", hvd.synchronize(hvd.broadcast_async(tensor(x, dtype), root)),
              data(root, dtype), dtype)
        t = tensor(x, dtype)
        hvd.broadcast_(t, root)
        check("broadcast_", t, data(root, dtype), dtype)
        t = tensor(x, dtype)
        hvd.synchronize(hvd.broadcast_async_(t, root))
        check("broadcast_async_", t, data(root, dtype), dtype)
        # alltoall: equal parts, then explicit splits (rank r sends j + 1 rows to rank j)
        a = data(R, dtype, rows=2 * N)
        want = np.concatenate([data(r, dtype, rows=2 * N)[2 * R:2 * R + 2] for r in range(N)])
        check("alltoall", hvd.alltoall(tensor(a, dtype)), want, dtype)
        out, _ = hvd.synchronize(hvd.alltoall_async(tensor(a, dtype)))
        check("alltoall_async", out, want, dtype)
        splits = [j + 1 for j in range(N)]
        a = data(R, dtype, rows=sum(splits))
        offs = np.cumsum([0] + splits)
        want = np.concatenate([data(r, dtype, rows=sum(splits))[offs[R]:offs[R + 1]]
                               for r in range(N)])
        out, received = hvd.alltoall(tensor(a, dtype), splits=splits)
        check("alltoall splits", out, want, dtype)
        check("alltoall received splits", received, np.full(N, R + 1.0), "int32")


def reduce_rows(op, dtype, rows):
    return reduce(op, dtype)[:rows]


def semantics() -> dict:
    out: dict = {}
    # Matched by name: ranks submit in opposite orders.
    names = ["a", "b", "c"] if R % 2 == 0 else ["c", "b", "a"]
    handles = {n: hvd.allreduce_async(torch.full((2,), float(ord(n) + R)), name=n, op=hvd.Sum)
               for n in names}
    for n in ("b", "a", "c") if R == 0 else names:
        got = hvd.synchronize(handles[n])
        want = sum(float(ord(n) + r) for r in range(N))
        check(f"matched by name {n}", got, np.full(2, want), "float64")
    # A shape that differs on the last rank: every rank gets the same one-line error.
    try:
        hvd.allreduce(torch.zeros(3 + (R == N - 1 and N > 1)), name="grads.w")
        out["mismatch"] = None
    except hvd.HorovodMismatchError as e:
        out["mismatch"] = str(e)
    # ... and the job goes on.
    check("after mismatch", hvd.allreduce(torch.ones(2), op=hvd.Sum), np.full(2, float(N)),
          "float32")
    # join: every rank but 0 joins at once; rank 0's allreduces see zeros from them.
    if R == 0:
        check("join allreduce", hvd.allreduce(torch.ones(3), op=hvd.Sum), np.ones(3), "float32")
    out["join_last"] = hvd.join()
    out["objects"] = [hvd.broadcast_object({"from": R, "epoch": 3}, root_rank=N - 1),
                      hvd.allgather_object((R, "x" * R))]
    hvd.barrier()
    # hvd.elastic in memory (no dtrun run id here): commit keeps the state, restore returns to it
    model = torch.nn.Linear(2, 1)
    state = hvd.elastic.TorchState(model=model, optimizer=None, epoch=1)
    w0 = model.weight.detach().clone()
    state.commit()
    with torch.no_grad():
        model.weight.add_(1.0)
    state.epoch = 5
    state.restore()
    out["elastic"] = [bool(torch.equal(model.weight, w0)), state.epoch,
                      sorted(n for n in ("run", "TorchState", "ElasticSampler", "ObjectState") if hasattr(hvd.elastic, n))]
    out["queries"] = [hvd.mpi_built(), hvd.mpi_enabled(), hvd.gloo_built(), hvd.nccl_built(),
                      hvd.is_initialized(), hvd.local_size(), hvd.cross_size()]
    return out


# ----------------------------------------------------------------------------- training
STEPS, BATCH = 12, 12


def build(sync: bool) -> torch.nn.Module:
    bn2, bn1 = (hvd.SyncBatchNorm, hvd.SyncBatchNorm) if sync else \
        (torch.nn.BatchNorm2d, torch.nn.BatchNorm1d)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), bn2(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 5, 8), bn1(8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(STEPS, BATCH, 2, 5, 5, generator=g),
            torch.randint(0, 3, (STEPS, BATCH), generator=g))


def train(distributed: bool) -> dict:
    # Rank 0 starts where the reference does, the others elsewhere: broadcast fixes them.
    torch.manual_seed(100 + (R if distributed else 0))
    model = build(sync=distributed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if distributed:
        # Small buckets: gradients are reduced by the background thread while
        # SyncBatchNorm's backward runs its own allreduces.
        os.environ["HOROVOD_FUSION_THRESHOLD"] = "512"
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    x, y = batches()
    lo, hi = (R * BATCH // N, (R + 1) * BATCH // N) if distributed else (0, BATCH)
    for step in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[step, lo:hi]), y[step, lo:hi])
        loss.backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def predivide() -> dict:
    """Gradients of 60000 on every rank: their float16 sum overflows unless predivided."""
    out = {}
    for f in (1.0, float(N)):
        p = torch.nn.Parameter(torch.zeros(4))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("p", p)],
                                       compression=hvd.Compression.fp16,
                                       gradient_predivide_factor=f)
        (p * 60000.0).sum().backward()
        opt.synchronize()
        out[str(f)] = p.grad.tolist()
        opt.remove_hooks()
    return out


def main() -> None:
    out_dir = sys.argv[1]
    collectives()
    result = semantics()
    ref = train(False)
    dist = train(True)
    np.savez(f"{out_dir}/rank.{R}.npz", **{f"ref.{k}": v for k, v in ref.items()},
             **{f"dist.{k}": v for k, v in dist.items()})
    result.update(rank=R, size=N, checked=checked, failures=failures[:20],
                  predivide=predivide() if N > 1 else None)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
