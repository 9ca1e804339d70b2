"""Horovod's reductions for PyTorch, asynchronous and in place: allreduce,
grouped_allreduce, reducescatter, grouped_reducescatter (``*_async``, ``*_``) and
sparse_allreduce_async. The blocking, differentiable forms are in ``grads.py``.

Arithmetic as Horovod's on the CPU (``_base.reduce_np``): prescale, reduce, postscale,
float16 and bfloat16 scaled in float32 and rounded once, an average as a postscale.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ...dtypes import BFLOAT16

from .. import _adasum, _core
from .._core import Adasum, Average, Max, Min, Product, Sum, global_process_set
from . import _base
from .gather import allgather_async
from ._base import check_adasum, reduce_np, reducescatter_np, scope, shares_memory, submit, \
    to_np, to_tensor, write_back

REDUCE_OPS = (Average, Sum, Min, Max, Product, Adasum)


def parse_op(op: Any, average: Any, where: str) -> str:
    """Horovod's ``op`` and deprecated ``average`` arguments as one op (default Average)."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one "
                             "of them.")
        return _core.check_op(op, where, REDUCE_OPS)
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in "
                      "v1.0", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


# ----------------------------------------------------------------------------- allreduce
def allreduce_start(tensor, inplace, name, op, pre, post, process_set, where) -> _base.Handle:
    """Submit an allreduce of ``tensor`` (``op`` parsed already)."""
    sc = scope(process_set, where)
    if op == Adasum:
        check_adasum(sc, where)
    x = to_np(tensor, where, sc)
    view = isinstance(tensor, torch.Tensor) and shares_memory(tensor)

    def run():
        y = reduce_np(sc.comm, x, op, pre, post, inplace=inplace)
        return write_back(tensor, y, view) if inplace else to_tensor(y, tensor)
    return submit(sc, "allreduce", name, [x], run, op)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Start an allreduce (default op Average); ``synchronize`` returns a new tensor."""
    op = parse_op(op, average, "allreduce_async")
    return allreduce_start(tensor, False, name, op, prescale_factor, postscale_factor,
                           process_set, "allreduce_async")


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Start an in-place allreduce; ``synchronize`` returns ``tensor``, reduced."""
    op = parse_op(op, average, "allreduce_async_")
    return allreduce_start(tensor, True, name, op, prescale_factor, postscale_factor,
                           process_set, "allreduce_async_")


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` in place; returns it."""
    return _base.synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                              postscale_factor, process_set))


# ----------------------------------------------------------------------------- grouped
def grouped_reduce_np(comm: Any, ys: list, op: str, pre: float, post: float,
                      fuse: bool = True) -> None:
    """Horovod's grouped allreduce of ``ys``, in place: fused into few buffers where no
    scaling or rounding is involved and ``fuse`` (no rank has joined)."""
    if op == Adasum:
        if pre != 1.0:
            for y in ys:
                y[...] = _base.scaled(y, pre)
        for y, r in zip(ys, _adasum.adasum_allreduce_many(comm, ys, check=False)):
            y[...] = _base.scaled(r, post) if post != 1.0 else r
    elif fuse and pre == 1.0 and post == 1.0 and not any(
            y.dtype == BFLOAT16 or (op == Average and y.dtype.kind in "iub") for y in ys):
        comm.grouped_allreduce(ys, op=op)
    else:
        # One allreduce per tensor: also what a joined rank stands in with (_engine.stand_in).
        for y in ys:
            reduce_np(comm, y, op, pre, post, inplace=True)


def grouped_allreduce_start(tensors, inplace, name, op, pre, post, process_set, where):
    """Submit a grouped allreduce of ``tensors`` (``op`` parsed already)."""
    sc = scope(process_set, where)
    tensors = _nonempty(tensors, where)
    if op == Adasum:
        check_adasum(sc, where)
    xs = [to_np(t, where, sc) for t in tensors]
    views = [isinstance(t, torch.Tensor) and shares_memory(t) for t in tensors]

    def run():
        ys = xs if inplace else [x.copy() for x in xs]
        grouped_reduce_np(sc.comm, ys, op, pre, post, fuse=not sc.engine.joined_now)
        if inplace:
            return [write_back(t, y, v) for t, y, v in zip(tensors, ys, views)]
        return [to_tensor(y, t) for y, t in zip(ys, tensors)]
    return submit(sc, "grouped_allreduce", name, xs, run, op)


def _nonempty(tensors: Any, where: str) -> list:
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{where}: expected a non-empty list of tensors")
    return tensors


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Start a grouped allreduce; ``synchronize`` returns a list of new tensors."""
    op = parse_op(op, average, "grouped_allreduce_async")
    return grouped_allreduce_start(tensors, False, name, op, prescale_factor, postscale_factor,
                                   process_set, "grouped_allreduce_async")


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Start an in-place grouped allreduce; ``synchronize`` returns ``tensors``, reduced."""
    op = parse_op(op, average, "grouped_allreduce_async_")
    return grouped_allreduce_start(tensors, True, name, op, prescale_factor, postscale_factor,
                                   process_set, "grouped_allreduce_async_")


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensors`` in place as one fused operation; returns them."""
    return _base.synchronize(grouped_allreduce_async_(tensors, average, name, op,
                                                      prescale_factor, postscale_factor,
                                                      process_set))


# ----------------------------------------------------------------------------- reducescatter
def _reducescatter_op(op: Any, where: str) -> str:
    """Horovod's reducescatter takes Average and Sum; anything else fails at the call
    (Horovod: a HorovodInternalError, a RuntimeError)."""
    op = Average if op is None else op
    if op not in (Average, Sum):
        raise _core.HorovodInternalError(
            where, _core.job(where).rank, "Reducescatter currently only supports AVERAGE and "
            f"SUM (got op={op!r})")
    return op


def _scatterable(tensor: Any, where: str, sc: Any) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.dim() == 0:
        raise ValueError(f"{where} on rank {sc.ranks[sc.rank]}: a scalar cannot be scattered; "
                         "pass a tensor with at least one dimension")


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Start a reducescatter; ``synchronize`` returns this rank's rows of the reduction."""
    where = "reducescatter_async"
    op = _reducescatter_op(op, where)
    sc = scope(process_set, where)
    x = to_np(tensor, where, sc)
    _scatterable(tensor, where, sc)
    return submit(sc, "reducescatter", name, [x], lambda: to_tensor(
        reducescatter_np(sc.comm, x, op, prescale_factor, postscale_factor), tensor), op)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start a reducescatter of each of ``tensors`` as one operation; ``synchronize``
    returns a list of this rank's rows of each."""
    where = "grouped_reducescatter_async"
    op = _reducescatter_op(op, where)
    sc = scope(process_set, where)
    tensors = _nonempty(tensors, where)
    xs = [to_np(t, where, sc) for t in tensors]
    for t in tensors:
        _scatterable(t, where, sc)

    def run():
        return [to_tensor(reducescatter_np(sc.comm, x, op, prescale_factor, postscale_factor), t)
                for x, t in zip(xs, tensors)]
    return submit(sc, "grouped_reducescatter", name, xs, run, op)


# ----------------------------------------------------------------------------- sparse
class SparseHandle:
    """What ``sparse_allreduce_async`` returns: call it (or pass it to ``synchronize``)
    for the reduced sparse tensor, as Horovod's."""

    def __init__(self, tensor: torch.Tensor, op: str, size: int, indices: Any, values: Any):
        self.tensor, self.op, self.size = tensor, op, size
        self.indices, self.values = indices, values

    def poll(self) -> bool:
        return _base.poll(self.indices) and _base.poll(self.values)

    def __call__(self) -> torch.Tensor:
        values = _base.synchronize(self.values)
        indices = _base.synchronize(self.indices)
        if self.op == Average:
            values = values / self.size
        t = self.tensor
        if indices.dim() == 0 or values.dim() == 0:
            return torch.sparse_coo_tensor(size=t.size(), dtype=t.dtype, device=t.device,
                                           check_invariants=False)
        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, t.size(),
                                       check_invariants=False)


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Start the reduction of a sparse tensor as Horovod does it: an allgather of every
    rank's indices and of its values (duplicates are summed when the result is
    coalesced; an average divides the values by the set's size). Returns a handle to
    call, or to pass to ``synchronize``, for the sparse result."""
    op = _core.check_op(op, "sparse_allreduce_async", (Average, Sum))
    sc = scope(process_set, "sparse_allreduce_async")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async: expected a sparse torch.Tensor (COO); "
                         "reduce a dense one with allreduce")
    t = tensor
    base = None if name is None else str(name)
    indices = allgather_async(t._indices().transpose(0, 1).contiguous(),
                              name=None if base is None else f"{base}.indices",
                              process_set=process_set)
    values = allgather_async(t._values().contiguous(),
                             name=None if base is None else f"{base}.values",
                             process_set=process_set)
    return SparseHandle(t, op, sc.size, indices, values)


__all__ = ["allreduce_async", "allreduce_async_", "allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_allreduce_", "reducescatter_async",
           "grouped_reducescatter_async", "sparse_allreduce_async"]
