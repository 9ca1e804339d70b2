"""Horovod's model-state helpers for PyTorch: ``broadcast_parameters``,
``broadcast_optimizer_state``, and ``join``. (``broadcast_object``, ``allgather_object``
and ``barrier`` are ``_core``'s, for every framework.)"""

from __future__ import annotations

from typing import Any

import torch

from ...checkpoint import to_cpu
from .. import _core
from .._core import global_process_set
from . import _base, gather


def broadcast_parameters(params: Any, root_rank: int, process_set=global_process_set) -> None:
    """Overwrite every rank's ``params`` with root's, in place, as Horovod does: one
    broadcast per tensor, named by its key. ``params``: ``model.state_dict()`` (a dict:
    matched by its sorted keys), a list of tensors or of (name, tensor) pairs, or
    ``model.named_parameters()``. Names, shapes and dtypes must match on every rank
    (checked by each broadcast, naming the rank)."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, torch.Tensor) or not hasattr(params, "__iter__"):
        raise ValueError(f"invalid params of type: {type(params)}")
    else:
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = [gather.broadcast_async_(p, root_rank, name, process_set) for name, p in params]
    for h in handles:
        _base.synchronize(h)


def _is_distributed(optimizer: Any) -> bool:
    return hasattr(optimizer, "_dp_setup") or hasattr(optimizer, "_hvd_setup")


def _create_state(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Horovod's way to give a fresh optimizer its state before broadcasting it: every
    parameter that requires a gradient gets a zero gradient (sparse for SparseAdam, and
    for SGD on a sparse embedding of ``model``), then one step of the wrapped optimizer."""
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p.data)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    if _is_distributed(optimizer):
        super(optimizer.__class__, optimizer).step()  # the wrapped optimizer's step
    else:
        optimizer.step()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Any = None) -> None:
    """Give every rank root's optimizer state (moments, step counts, learning rates).

    As Horovod's: an optimizer without state yet first gets one (zero gradients, left in
    ``.grad``, and one step); one whose state stays empty broadcasts nothing."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if len(optimizer.state_dict()["state"]) == 0:
        _create_state(optimizer, model)
        if len(optimizer.state_dict()["state"]) == 0:
            return
    j = _core.job("broadcast_optimizer_state")
    mine = to_cpu(optimizer.state_dict()) if j.rank == int(root_rank) else None
    state = _core.broadcast_object(mine, root_rank, "broadcast_optimizer_state")
    if j.rank != int(root_rank):
        optimizer.load_state_dict(state)  # casts tensors to each parameter's device


def join(device: int = -1, process_set=global_process_set) -> int:
    """This rank has no more data: take part in the other ranks' allreduces with zeros
    until every rank of the set has joined. Returns the rank that joined last.

    As Horovod's, join covers allreduce: an allgather, broadcast, alltoall or
    reducescatter while a rank has joined fails on the ranks that submitted it. A
    ``DistributedOptimizer`` step on another rank waits for this rank instead: give
    every rank the same number of steps (``collectives.dp.shard`` does)."""
    return int(_base.scope(process_set, "join").engine.join())


__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "join"]
