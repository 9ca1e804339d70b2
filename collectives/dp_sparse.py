"""Sparse gradients gathered as Horovod's sparse allreduce does (``sparse_as_dense=False``).

Every rank's indices and values of a sparse gradient (``nn.Embedding(sparse=True)``)
are gathered into one sparse gradient, whose duplicates sum when it is coalesced;
cheaper than a dense allreduce for a large, sparsely used embedding. Separate from the
bucket path (``dp_buckets``): these gradients never enter a bucket's buffer, only its
flags say which ranks had one.
"""

from __future__ import annotations

import torch

from .dp_buckets import Bucket, Slot
from .dp_context import AVG, LOCK, Context, allgather_objects


def gather_sparse(buckets: list[Bucket], ctx: Context, op: str) -> None:
    """Reduce the sparse gradients kept aside (``sparse_as_dense=False``) as Horovod's
    sparse allreduce does: every rank's indices and values gathered into one sparse
    gradient (its duplicates sum when it is coalesced), the values divided by the size
    for op avg. A parameter some rank had a dense gradient for gets the sum of both."""
    todo = []
    for b in buckets:
        sparse, dense = b.sparse_flags.tolist(), b.flags.tolist()
        for s in b.slots:
            s.gathered = sparse[s.index] != 0
            if s.gathered:
                todo.append((s, dense[s.index] != 0))
    if not todo:
        return
    metas = allgather_objects([None if s.sparse is None else s.sparse.sparse_dim()
                               for s, _ in todo])
    for i, (s, mixed) in enumerate(todo):
        dims = next(m[i] for m in metas if m[i] is not None)
        _gather_one(s, dims, mixed, ctx, op)
        s.sparse = None


def _gather_one(s: Slot, sparse_dim: int, mixed: bool, ctx: Context, op: str) -> None:
    p = s.param
    if s.sparse is None:  # no sparse gradient here: this rank adds no rows
        dtype = p.grad.dtype if p.grad is not None else p.dtype
        idx = torch.zeros((0, sparse_dim), dtype=torch.int64)
        val = torch.zeros((0,) + tuple(p.shape[sparse_dim:]), dtype=dtype)
    else:
        idx = s.sparse._indices().t().contiguous().cpu()
        val = s.sparse._values().contiguous().cpu()
    bf16 = val.dtype == torch.bfloat16  # MPI moves its bits
    with LOCK:
        gi = ctx.comm.allgatherv(idx.numpy())
        gv = ctx.comm.allgatherv((val.view(torch.int16) if bf16 else val).numpy())
    values = torch.from_numpy(gv)
    values = (values.view(torch.bfloat16) if bf16 else values).to(p.device)
    if op == AVG:
        values = values / ctx.size
    result = torch.sparse_coo_tensor(torch.from_numpy(gi).t().to(p.device), values, p.shape,
                                     check_invariants=False)
    with torch.no_grad():
        if mixed:  # the dense part was reduced in the bucket: add the two
            both = p.grad.to_dense() + result.to_dense()
            p.grad = both.to_sparse(sparse_dim) if p.grad.is_sparse else both
        else:
            p.grad = result
