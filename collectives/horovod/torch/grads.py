"""Horovod's blocking collectives for PyTorch, each an autograd function whose gradient
is Horovod's (``horovod/torch/mpi_ops.py``):

* allreduce, grouped_allreduce: the same reduction of the gradient (same op and factors);
* allgather, grouped_allgather: the gradient averaged over the set, then this rank's rows;
* broadcast: the gradient averaged over the set on the root, zero elsewhere;
* alltoall: the gradient sent back with the splits received;
* reducescatter, grouped_reducescatter: the gradient times the set's size (op Sum) and the
  factors, allgathered.
"""

from __future__ import annotations

import torch

from .._core import Average, Sum, global_process_set
from . import _base, gather, ops
from .compression import Compression


def _compress(compression, tensor):
    """``compression.compress(tensor)``; what is not a tensor goes on as it is (refused)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor, None
    return compression.compress(tensor)


def _set_rank_size(process_set, where: str) -> tuple[int, int]:
    sc = _base.scope(process_set, where)
    return sc.rank, sc.size


# ----------------------------------------------------------------------------- allreduce
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, process_set):
        ctx.args = (op, pre, post, process_set)
        return _base.synchronize(ops.allreduce_start(tensor, False, name, op, pre, post,
                                                     process_set, "allreduce"))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, process_set = ctx.args
        return (allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post,
                          process_set=process_set), None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over the process set (default: average); a new tensor."""
    op = ops.parse_op(op, average, "allreduce")
    compressed, cctx = _compress(compression, tensor)
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, cctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, process_set, *tensors):
        ctx.args = (op, pre, post, process_set)
        return tuple(_base.synchronize(ops.grouped_allreduce_start(
            tensors, False, name, op, pre, post, process_set, "grouped_allreduce")))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        reduced = grouped_allreduce(list(grads), op=op, prescale_factor=pre,
                                    postscale_factor=post, process_set=process_set)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Reduce a list of tensors as one operation; a list of new tensors."""
    op = ops.parse_op(op, average, "grouped_allreduce")
    pairs = [_compress(compression, t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


# ----------------------------------------------------------------------------- allgather
def _rows(shape) -> int:
    return shape[0] if len(shape) else 1


def _my_rows(grad_reduced, process_set, counts: list, where: str):
    """This rank's rows of an allgather's averaged gradient (``counts``: each rank's)."""
    r, _ = _set_rank_size(process_set, where)
    return grad_reduced.narrow(0, sum(counts[:r]), counts[r])


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.shape, ctx.process_set = tensor.shape, process_set
        return _base.synchronize(gather.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        rows = torch.tensor([_rows(ctx.shape)], dtype=torch.int32)
        counts = allgather(rows, process_set=ctx.process_set).tolist()
        mine = _my_rows(reduced, ctx.process_set, counts, "allgather")
        return mine.reshape(ctx.shape), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension (its length may
    differ per rank; the other dimensions must match: checked, naming the rank)."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.shapes, ctx.process_set = [t.shape for t in tensors], process_set
        return tuple(_base.synchronize(gather.grouped_allgather_async(tensors, name,
                                                                      process_set)))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ps)
        rows = [torch.tensor([_rows(s)], dtype=torch.int32) for s in ctx.shapes]
        counts = [c.tolist() for c in grouped_allgather(rows, process_set=ps)]
        return (None, None, *[_my_rows(g, ps, c, "grouped_allgather").reshape(s)
                              for g, c, s in zip(reduced, counts, ctx.shapes)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather each of ``tensors`` as one operation; a tuple of gathered tensors."""
    return _GroupedAllgather.apply(name, process_set, *tensors)


# ----------------------------------------------------------------------------- broadcast
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _base.synchronize(gather.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        sc = _base.scope(ctx.process_set, "broadcast")
        if sc.ranks[sc.rank] != int(ctx.root_rank):
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Root's ``tensor`` on every rank of the set (a new tensor)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# ----------------------------------------------------------------------------- alltoall
class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _base.synchronize(gather.alltoall_async(tensor, splits, name,
                                                                process_set))
        ctx.process_set, ctx.received, ctx.rows = process_set, received, _rows(tensor.shape)
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *_received):
        back, _ = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        if back.shape[0] < ctx.rows:  # rows past the splits' sum were not sent
            pad = back.new_zeros((ctx.rows - back.shape[0],) + tuple(back.shape[1:]))
            back = torch.cat([back, pad])
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rank i sends rows ``splits[j]`` of ``tensor`` to rank j of the set (default: equal
    parts). Returns the received rows, and with ``splits`` also the rows received from
    each rank (an int32 tensor)."""
    return _Alltoall.apply(tensor, splits, name, process_set)


# ----------------------------------------------------------------------------- reducescatter
def _scatter_grad(grad, op, pre, post, size: int):
    """Horovod's reducescatter gradient before its allgather."""
    if op == Sum:
        grad = grad * size
    if pre != 1.0:
        grad = grad * pre
    if post != 1.0:
        grad = grad * post
    return grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, pre, post):
        ctx.args = (op, pre, post, process_set)
        return _base.synchronize(ops.reducescatter_async(tensor, name, op, process_set, pre,
                                                         post))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        _, size = _set_rank_size(ps, "reducescatter")
        return (allgather(_scatter_grad(grad, op, pre, post, size), process_set=ps),
                None, None, None, None, None)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over the set (default: average), then rank r keeps its share of the first
    dimension (the first ``n % size`` ranks get one row more)."""
    compressed, cctx = _compress(compression, tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, cctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, pre, post, *tensors):
        ctx.args = (op, pre, post, process_set)
        return tuple(_base.synchronize(ops.grouped_reducescatter_async(
            tensors, name, op, process_set, pre, post)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        _, size = _set_rank_size(ps, "grouped_reducescatter")
        scaled = [_scatter_grad(g, op, pre, post, size) for g in grads]
        return (None, None, None, None, None, *grouped_allgather(scaled, process_set=ps))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reducescatter each of ``tensors`` as one operation; a list of this rank's parts."""
    pairs = [_compress(compression, t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                       postscale_factor, *[p[0] for p in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "alltoall", "reducescatter", "grouped_reducescatter"]
