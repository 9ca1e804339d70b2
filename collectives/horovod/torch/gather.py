"""Horovod's data movements for PyTorch, asynchronous and in place: allgather,
grouped_allgather, broadcast (``broadcast_async``, ``broadcast_async_``, ``broadcast_``)
and alltoall. The blocking, differentiable forms are in ``grads.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _core
from .._core import global_process_set
from . import _base
from ._base import scope, shares_memory, submit, to_np, to_tensor, write_back


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start an allgather; ``synchronize`` returns every rank's ``tensor`` concatenated
    along the first dimension (its length may differ per rank)."""
    sc = scope(process_set, "allgather_async")
    x = to_np(tensor, "allgather_async", sc)
    return submit(sc, "allgather", name, [x],
                  lambda: to_tensor(_core.np_allgather(sc.comm, x), tensor))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start an allgather of each of ``tensors`` as one operation; ``synchronize``
    returns the list of gathered tensors."""
    where = "grouped_allgather_async"
    sc = scope(process_set, where)
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{where}: expected a non-empty list of tensors")
    xs = [to_np(t, where, sc) for t in tensors]
    return submit(sc, "grouped_allgather", name, xs, lambda: [
        to_tensor(_core.np_allgather(sc.comm, x), t) for x, t in zip(xs, tensors)])


# ----------------------------------------------------------------------------- broadcast
def broadcast_start(tensor, root_rank, name, inplace, process_set, where) -> _base.Handle:
    """Submit a broadcast from ``root_rank`` (a job rank, as Horovod's)."""
    sc = scope(process_set, where)
    root = _core.set_root(sc, root_rank, where)
    x = to_np(tensor, where, sc)
    view = isinstance(tensor, torch.Tensor) and shares_memory(tensor)

    def run():
        y = x if inplace else x.copy()
        sc.comm.broadcast(_core.bits(y), root=root, inplace=True)
        return write_back(tensor, y, view) if inplace else to_tensor(y, tensor)
    return submit(sc, "broadcast", name, [x], run, root=int(root_rank))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start a broadcast; ``synchronize`` returns root's ``tensor`` (a new tensor)."""
    return broadcast_start(tensor, root_rank, name, False, process_set, "broadcast_async")


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start an in-place broadcast; ``synchronize`` returns ``tensor``, overwritten."""
    return broadcast_start(tensor, root_rank, name, True, process_set, "broadcast_async_")


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with root's, in place; returns it."""
    return _base.synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ----------------------------------------------------------------------------- alltoall
def _splits(splits: Any, rows: int, sc: Any, where: str) -> np.ndarray:
    """Horovod's checks of ``splits`` (each a ValueError at the call): 32-bit integers,
    one dimension, one entry per rank of the set summing to at most ``rows``; without
    splits, ``rows`` must divide evenly."""
    me = sc.ranks[sc.rank]
    if splits is None:
        if rows % sc.size:
            raise ValueError(f"{where} on rank {me}: splits not provided, but the first "
                             f"dimension of the tensor ({rows}) is not an even multiple of "
                             f"the number of workers ({sc.size})")
        return np.full(sc.size, rows // sc.size, dtype=np.int64)
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"{where} on rank {me}: alltoall expects splits to contain 32-bit "
                             f"integer elements (got {splits.dtype})")
        sp = splits.detach().cpu().numpy()
    else:
        sp = np.asarray(splits)
        if sp.size and sp.dtype.kind not in "iu":
            raise ValueError(f"{where} on rank {me}: splits must be integers (got {sp.dtype})")
    if sp.ndim > 1:
        raise ValueError(f"{where} on rank {me}: alltoall expects a 1D splits tensor")
    if sp.size != sc.size:
        raise ValueError(f"{where} on rank {me}: Number of entries in splits ({sp.size}) does "
                         f"not equal number of workers ({sc.size}).")
    sp = sp.astype(np.int64)
    if (sp < 0).any() or sp.sum() > rows:
        raise ValueError(f"{where} on rank {me}: Sum of splits entries is greater than the "
                         f"first dimension of tensor ({sp.tolist()} > {rows} rows)")
    return sp


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start an alltoall: rows ``splits[j]`` of ``tensor`` go to rank j of the set
    (default: equal parts); ``synchronize`` returns (received rows, rows received from
    each rank, an int32 tensor)."""
    where = "alltoall_async"
    sc = scope(process_set, where)
    x = to_np(tensor, where, sc)
    if isinstance(tensor, torch.Tensor):
        rows = tensor.shape[0] if tensor.dim() else 1
        sp = _splits(splits, rows, sc, where)
        x = x.reshape((1,) if x.ndim == 0 else x.shape)[:int(sp.sum())]
    else:
        sp = None
    like = splits if isinstance(splits, torch.Tensor) else None

    def run():
        out, received = _core.np_alltoall(sc.comm, x, sp)
        got = torch.from_numpy(received.astype(np.int32))
        return to_tensor(out, tensor), (got.to(like.device) if like is not None else got)
    return submit(sc, "alltoall", name, [x], run)


__all__ = ["allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_",
           "broadcast_", "alltoall_async"]
