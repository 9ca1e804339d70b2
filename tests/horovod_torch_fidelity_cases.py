"""Rank program for tests/test_horovod_torch_fidelity.py (2 ranks): where the adapter
once differed from Horovod 0.28.1's ``horovod.torch``, each rank checks it against NumPy.

* gradients: allgather and broadcast average over ranks (once summed, 2x Horovod's);
  allreduce with Max, alltoall, reducescatter and the grouped forms have Horovod's;
* prescale/postscale: float16 and bfloat16 scaled in float32, integers in float64 (the
  reducescatter forms hung);
* grouped_allgather, grouped_reducescatter; sparse_allreduce_async and sparse embeddings
  in DistributedOptimizer (both sparse_as_dense settings);
* process sets; a second ``init()`` on one rank alone; Horovod's error types on every
  rank; Adasum; the warning of ``step()`` after ``synchronize()``; the zero gradients
  ``broadcast_optimizer_state`` leaves on a fresh optimizer.

Each rank prints one line ``RESULT {json}`` (``failures`` empty when all is well).
Usage: python tests/horovod_torch_fidelity_cases.py [CASE ...]
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings

import numpy as np
import torch

import dtrun.collectives.horovod.torch as hvd
from horovod_common import compared  # noqa: E402 (this script's folder)
from horovod_common import raises as _raises  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()

failures: list[str] = []
ran: list[str] = []


def same(what: str, got, want, atol: float = 0.0) -> None:
    compared(failures, what, got.detach().to(torch.float64).numpy()
             if isinstance(got, torch.Tensor) else np.asarray(got, dtype=np.float64), want, atol)


def raises(what: str, kinds, call, *needles) -> None:
    """``call()`` must raise one of ``kinds`` whose message holds every needle."""
    _raises(failures, what, kinds, call, *needles)


def grad_of(x: torch.Tensor, out: torch.Tensor, weight: np.ndarray) -> torch.Tensor:
    out.backward(torch.from_numpy(weight).to(out.dtype))
    return x.grad


def weight(shape, r: int) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + 10.0 * r


# ----------------------------------------------------------------------------- gradients
def gradients() -> None:
    rows = [r + 2 for r in range(N)]  # rank r contributes r + 2 rows
    x = torch.ones(rows[R], 3, requires_grad=True)
    g = grad_of(x, hvd.allgather(x), weight((sum(rows), 3), R))
    mean = np.mean([weight((sum(rows), 3), r) for r in range(N)], axis=0)
    same("allgather grad", g, mean[sum(rows[:R]):sum(rows[:R + 1])])

    xs = [torch.ones(rows[R], 2, requires_grad=True) for _ in range(2)]
    outs = hvd.grouped_allgather(xs)
    torch.autograd.backward(list(outs), [torch.from_numpy(weight((sum(rows), 2), R) * (i + 1))
                                         .float() for i in range(2)])
    mean = np.mean([weight((sum(rows), 2), r) for r in range(N)], axis=0)
    for i, t in enumerate(xs):
        same(f"grouped_allgather grad {i}", t.grad,
             (mean * (i + 1))[sum(rows[:R]):sum(rows[:R + 1])])

    x = torch.ones(4, requires_grad=True)
    g = grad_of(x, hvd.broadcast(x, N - 1), weight(4, R))
    mean = np.mean([weight(4, r) for r in range(N)], axis=0)
    same("broadcast grad", g, mean if R == N - 1 else np.zeros(4))

    x = torch.full((3,), float(R), requires_grad=True)
    g = grad_of(x, hvd.allreduce(x, op=hvd.Max), weight(3, R))
    same("allreduce Max grad (Horovod: the Max of the gradients)", g, weight(3, N - 1))

    _alltoall_grad()
    _reducescatter_grads()


def _alltoall_grad() -> None:
    # rank i sends i + j + 1 rows to rank j
    send = [[i + j + 1 for j in range(N)] for i in range(N)]
    x = torch.zeros(sum(send[R]), 2, requires_grad=True)
    splits = torch.tensor(send[R], dtype=torch.int32)
    out, received = hvd.alltoall(x, splits=splits)
    same("alltoall received splits", received, [send[i][R] for i in range(N)])
    g = grad_of(x, out, weight((sum(send[i][R] for i in range(N)), 2), R))
    want = []
    for j in range(N):  # rank j's gradient rows that came from this rank
        wj = weight((sum(send[i][j] for i in range(N)), 2), j)
        start = sum(send[i][j] for i in range(R))
        want.append(wj[start:start + send[R][j]])
    same("alltoall grad", g, np.concatenate(want))


def _reducescatter_grads() -> None:
    w = [weight((2, 3), r) for r in range(N)]
    for op, scale in ((hvd.Sum, N), (hvd.Average, 1)):
        x = torch.ones(2 * N, 3, requires_grad=True)
        g = grad_of(x, hvd.reducescatter(x, op=op), w[R])
        same(f"reducescatter grad op={op}", g, np.concatenate(w) * scale)
    xs = [torch.ones(2 * N, 3, requires_grad=True) for _ in range(2)]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum, prescale_factor=0.5)
    torch.autograd.backward(outs, [torch.from_numpy(w[R]).float()] * 2)
    for i, t in enumerate(xs):
        same(f"grouped_reducescatter grad {i}", t.grad, np.concatenate(w) * N * 0.5)


# ----------------------------------------------------------------------------- scaling
def _scaled(x: np.ndarray, f: float, dtype: torch.dtype) -> np.ndarray:
    """Horovod's CPU scaling of ``x`` (values of ``dtype``), as float64 values."""
    if dtype in (torch.int32, torch.int64):
        return np.trunc(x * f)
    t = torch.from_numpy(x.astype(np.float32) * np.float32(f))
    return t.to(dtype).to(torch.float64).numpy()


def scaling() -> None:
    rng = np.random.default_rng(1234)
    x = rng.integers(-100, 100, size=(4 * N, 5)).astype(np.float64)  # the same on every rank
    f = 0.3
    mine = slice(4 * R, 4 * R + 4)
    for dtype in (torch.float16, torch.bfloat16, torch.int32, torch.float32):
        t = torch.from_numpy(x).to(dtype)
        v = t.to(torch.float64).numpy()
        pre = _scaled(v, f, dtype) * N
        post = _scaled(v * N, f, dtype)
        name = str(dtype).replace("torch.", "")
        same(f"allreduce prescale {name}", hvd.allreduce(t, op=hvd.Sum, prescale_factor=f), pre)
        same(f"allreduce postscale {name}", hvd.allreduce(t, op=hvd.Sum, postscale_factor=f),
             post)
        if dtype != torch.bfloat16:
            same(f"reducescatter prescale {name}",
                 hvd.reducescatter(t, op=hvd.Sum, prescale_factor=f), pre[mine])
            same(f"reducescatter postscale {name}",
                 hvd.reducescatter(t, op=hvd.Sum, postscale_factor=f), post[mine])
            outs = hvd.grouped_reducescatter([t, t], op=hvd.Sum, prescale_factor=f)
            same(f"grouped_reducescatter prescale {name}", outs[1], pre[mine])
    # An integer average is the sum times postscale / size, truncated once.
    t = torch.from_numpy(x).to(torch.int64) + R
    total = sum(x + r for r in range(N))
    same("int average postscale", hvd.allreduce(t, op=hvd.Average, postscale_factor=3.0),
         np.trunc(total * (3.0 / N)))


# ----------------------------------------------------------------------------- grouped
def grouped() -> None:
    data = [np.full((r + 1, 2), float(r)) for r in range(N)]
    outs = hvd.grouped_allgather([torch.from_numpy(data[R]), torch.from_numpy(data[R][:, :1])])
    same("grouped_allgather [0]", outs[0], np.concatenate(data))
    same("grouped_allgather [1]", outs[1], np.concatenate(data)[:, :1])
    outs = hvd.synchronize(hvd.grouped_allgather_async([torch.ones(R + 1)]))
    same("grouped_allgather_async", outs[0], np.ones(sum(r + 1 for r in range(N))))
    # 5 rows over the ranks: the first 5 % N ranks get one more
    x = [np.arange(10.0).reshape(5, 2) * (r + 1) for r in range(N)]
    counts = [5 // N + (r < 5 % N) for r in range(N)]
    lo = sum(counts[:R])
    for op, total in ((hvd.Sum, sum(x)), (hvd.Average, sum(x) / N)):
        outs = hvd.grouped_reducescatter([torch.from_numpy(x[R]), torch.from_numpy(x[R] + 1)],
                                         op=op)
        same(f"grouped_reducescatter {op} [0]", outs[0], total[lo:lo + counts[R]])
        plus = total + (N if op == hvd.Sum else 1)
        same(f"grouped_reducescatter {op} [1]", outs[1], plus[lo:lo + counts[R]])
    outs = hvd.synchronize(hvd.grouped_reducescatter_async([torch.from_numpy(x[R])], op=hvd.Sum))
    same("grouped_reducescatter_async", outs[0], sum(x)[lo:lo + counts[R]])


# ----------------------------------------------------------------------------- sparse
def sparse() -> None:
    dense = [np.zeros((6, 2)) for _ in range(N)]
    for r in range(N):
        dense[r][[r, 3]] = [[1.0 + r, 2.0], [3.0, 4.0 * (r + 1)]]
    sp = torch.from_numpy(dense[R]).float().to_sparse(1)
    h = hvd.sparse_allreduce_async(sp, name="emb", op=hvd.Average)
    same("sparse_allreduce_async (called)", h().to_dense(), sum(dense) / N, 1e-6)
    h = hvd.sparse_allreduce_async(sp, name="emb", op=hvd.Sum)
    got = hvd.synchronize(h)
    same("sparse_allreduce_async (synchronize)", got.to_dense(), sum(dense), 1e-6)
    for as_dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 2, sparse=True)
        w0 = emb.weight.detach().double().numpy().copy()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=as_dense)
        ids = [[r, 3, 3] for r in range(N)]  # row 3 twice on every rank
        emb(torch.tensor(ids[R])).sum().backward()
        opt.step()
        grad = np.zeros((6, 2))
        for r in range(N):
            for i in ids[r]:
                grad[i] += 1.0 / N
        same(f"sparse embedding step (sparse_as_dense={as_dense})", emb.weight, w0 - grad, 1e-6)
        if not emb.weight.grad.is_sparse:
            failures.append(f"sparse_as_dense={as_dense}: .grad came back dense")


# ----------------------------------------------------------------------------- process sets
def process_sets() -> None:
    hvd.init()  # a second init returns at once ...
    if R == 0:
        hvd.init()  # ... and is no collective: rank 1 does not call it a third time
    same("after a second init", hvd.allreduce(torch.ones(2), op=hvd.Sum), np.full(2, float(N)))
    sets = [hvd.ProcessSet([r]) for r in range(N)]
    hvd.init(process_sets=sets)  # registers them on every rank
    mine = sets[R]
    same("allreduce on a set", hvd.allreduce(torch.ones(2) * (R + 5), op=hvd.Sum,
                                             process_set=mine), np.full(2, R + 5.0))
    same("allgather on a set", hvd.allgather(torch.ones(1) * R, process_set=mine), [float(R)])
    got = hvd.broadcast_object({"r": R}, root_rank=R, process_set=mine)
    if got != {"r": R}:
        failures.append(f"broadcast_object on a set: {got}")
    hvd.barrier(process_set=mine)
    raises("root_rank outside the set", ValueError,
           lambda: hvd.broadcast(torch.ones(1), (R + 1) % N, process_set=mine))
    # a DistributedOptimizer over a set of one rank: each rank steps alone
    p = torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("p", p)],
                                   process_set=mine)
    (p * (R + 1)).sum().backward()
    opt.step()
    same("DistributedOptimizer on a set", p, np.full(2, -(R + 1.0)))
    pair = hvd.add_process_set(list(range(N)) if N > 2 else [0, 1])
    if R in pair.ranks:
        p = torch.nn.Parameter(torch.zeros(2))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("p", p)],
                                       process_set=pair)
        (p * (R + 1)).sum().backward()
        opt.step()
        same("DistributedOptimizer on a pair", p, np.full(2, -np.mean([r + 1.0 for r in
                                                                       pair.ranks])))
    removed = [hvd.remove_process_set(s) for s in sets + [pair]]
    if removed != [True] * (N + 1):
        failures.append(f"remove_process_set returned {removed}")
    raises("a removed set", ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=mine))


# ----------------------------------------------------------------------------- errors
def errors() -> None:
    t = torch.ones(3)
    raises("shape mismatch", RuntimeError, lambda: hvd.allreduce(torch.ones(3 + R)),
           "rank 0", "rank 1")
    raises("dtype mismatch", RuntimeError,
           lambda: hvd.allreduce(t.to(torch.int32 if R else torch.float32)), "rank 0", "rank 1")
    raises("root mismatch", RuntimeError, lambda: hvd.broadcast(t, R), "rank 0", "rank 1")
    raises("allgather trailing shape", RuntimeError,
           lambda: hvd.allgather(torch.ones(2, 2 + R)), "rank 0", "rank 1")
    raises("reducescatter shape", RuntimeError, lambda: hvd.reducescatter(torch.ones(2, 2 + R)))
    raises("bad root_rank", ValueError, lambda: hvd.broadcast(t, N + 3), str(N + 3))
    raises("op and average", ValueError, lambda: hvd.allreduce(t, average=True, op=hvd.Sum))
    raises("splits not int32", ValueError,
           lambda: hvd.alltoall(torch.ones(N), torch.ones(N, dtype=torch.float32)))
    raises("splits sum", ValueError,
           lambda: hvd.alltoall(torch.ones(N - 1), torch.ones(N, dtype=torch.int32)))
    raises("uneven alltoall", ValueError, lambda: hvd.alltoall(torch.ones(N + 1)))
    raises("reducescatter op=Min", RuntimeError, lambda: hvd.reducescatter(t, op=hvd.Min))
    raises("reducescatter op=Adasum", RuntimeError, lambda: hvd.reducescatter(t, op=hvd.Adasum))
    raises("reducescatter scalar", (RuntimeError, ValueError),
           lambda: hvd.reducescatter(torch.tensor(1.0)))
    # A duplicate pending name: a ValueError at once, on the rank that repeats it (the
    # other rank submits that name only after the barrier).
    handles = {}
    for turn in range(N):
        if R == turn:
            handles[R] = hvd.allreduce_async(t, name=f"dup.{R}")
            raises("duplicate name", ValueError,
                   lambda: hvd.allreduce_async(t, name=f"dup.{R}"), f"dup.{R}")
        hvd.barrier()
    for r in range(N):
        if r != R:
            handles[r] = hvd.allreduce_async(t, name=f"dup.{r}")
    for r, h in sorted(handles.items()):
        same(f"dup.{r} after the duplicate", hvd.synchronize(h), np.ones(3))
    # A name stays taken until its handle is synchronized, even once it has run (the
    # barrier, queued after it, ran after it): Horovod's tests repeat a name at once.
    h = hvd.allreduce_async(t, name="ran")
    hvd.barrier()
    raises("a name run but not synchronized", ValueError,
           lambda: hvd.allreduce_async(t, name="ran"), "allreduce.ran")
    same("the name synchronized", hvd.synchronize(h), np.ones(3))
    same("the name free again", hvd.allreduce(t, name="ran"), np.ones(3))


# ----------------------------------------------------------------------------- the rest
def adasum() -> None:
    a = [np.array([1.0, 2.0, 0.5, -1.0]) * (r + 1) + np.array([0, r, -r, 2 * r])
         for r in range(N)]
    if N != 2:
        return
    dot = a[0] @ a[1]
    want = (1 - dot / (2 * (a[0] @ a[0]))) * a[0] + (1 - dot / (2 * (a[1] @ a[1]))) * a[1]
    same("Adasum allreduce", hvd.allreduce(torch.from_numpy(a[R]), op=hvd.Adasum), want, 1e-12)
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("p", p)],
                                   op=hvd.Adasum)
    (p * torch.from_numpy(a[R])).sum().backward()
    opt.step()
    same("Adasum DistributedOptimizer", p, -want, 1e-12)


def optimizer_details() -> None:
    model = torch.nn.Linear(2, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    said = [str(w.message) for w in caught if "skip_synchronize" in str(w.message)]
    if len(said) != 1 or not said[0].startswith("optimizer.step() called without "
                                                "optimizer.skip_synchronize()"):
        failures.append(f"step after synchronize warned {[str(w.message) for w in caught]}")
    fresh = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=fresh.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if any(p.grad is None for p in fresh.parameters()):
        failures.append("broadcast_optimizer_state left .grad None on a fresh optimizer")
    else:
        same("grad after broadcast_optimizer_state", fresh.weight.grad, np.zeros((1, 2)))


CASES = (gradients, scaling, grouped, sparse, process_sets, errors, adasum, optimizer_details)


def main() -> None:
    chosen = sys.argv[1:]  # case names (default: every case)
    for case in [c for c in CASES if not chosen or c.__name__ in chosen]:
        try:
            case()
            ran.append(case.__name__)
        except Exception as e:  # noqa: BLE001 — reported, and the next case runs
            failures.append(f"{case.__name__}: {type(e).__name__}: {e} "
                            f"{traceback.format_exc(limit=-2)!r}")
        hvd.barrier()
    print("RESULT " + json.dumps({"rank": R, "size": N, "ran": ran, "failures": failures}),
          flush=True)


if __name__ == "__main__":
    main()
