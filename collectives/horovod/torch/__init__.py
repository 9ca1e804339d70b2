"""``horovod.torch`` on dtrun's runtime: ``import dtrun.collectives.horovod.torch as hvd``.

Collectives run on ``collectives.Comm`` (matched by name across ranks, see
``collectives/horovod/_core.py``); ``DistributedOptimizer``, ``broadcast_parameters`` and
``broadcast_optimizer_state`` are ``collectives.dp``'s with Horovod's argument names.
Imports torch, never TensorFlow.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
import torch

from .. import _core
from .._core import *  # noqa: F401,F403 (the framework-neutral API: _core.__all__)
from .._core import Average, Max, Min, Product, Sum, global_process_set, rank, size
from .compression import Compression
from .sync_batch_norm import SyncBatchNorm  # noqa: F401

__all__ = _core.__all__ + [
    "init", "nccl_built", "cuda_built",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "join", "poll", "synchronize", "broadcast_object", "allgather_object",
    "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
    "Compression", "SyncBatchNorm",
]


# ----------------------------------------------------------------------------- start-up
def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start (or join) the job (collective on first call).

    Horovod's ``init(comm=[ranks])`` subsets and ``process_sets`` are not provided; a
    ``collectives.Comm`` may be passed as ``comm``.
    """
    _core.check_init_args(comm, process_sets)
    import dtrun.collectives.dp as dp
    from ..._mpi import MPI
    ctx = dp.init(comm)
    # The hvd collectives run on their own duplicate of the world, so that an
    # hvd.allreduce issued while DistributedOptimizer's background thread reduces a
    # bucket can never be matched with that bucket on another rank. With
    # MPI_THREAD_MULTIPLE the two communicators are used at once without a shared lock:
    # holding collectives.dp's lock across an hvd collective (SyncBatchNorm's, during
    # backward) could wait on a rank whose background thread waits on this one.
    multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
    _core.init(ctx.comm.split(0), lock=None if multiple else dp._LOCK)


def _job(op: str) -> _core.Job:
    return _core.job(op)


def nccl_built() -> bool: return _core.flag("nccl_built") and torch.cuda.is_available()  # noqa: E704
def cuda_built() -> bool: return _core.flag("cuda_built") and torch.cuda.is_available()  # noqa: E704


def __getattr__(name: str):
    if name in _core.UNSUPPORTED:
        raise _core.unsupported(name)
    raise AttributeError(f"module 'dtrun.collectives.horovod.torch' has no attribute {name!r}")


# ----------------------------------------------------------------------------- tensors
class _NotATensor:
    """Stands in for an argument that is not a tensor: ``_submit`` refuses it."""

    shape = ()

    def __init__(self, value: Any):
        self.type = type(value).__name__
        self.dtype = _core.NOT_A_TENSOR + self.type


def _np(t: torch.Tensor, op: str) -> np.ndarray:
    """A CPU NumPy view of ``t`` (bfloat16 as the runtime's bfloat16); GPU tensors copied."""
    if not isinstance(t, torch.Tensor):
        return _NotATensor(t)
    from ...arrays import torch_to_numpy
    src = t.detach()
    if src.device.type != "cpu":
        src = src.cpu()
    if not src.is_contiguous():
        src = src.contiguous()
    return torch_to_numpy(src, op, _job(op).rank)


def _tensor(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    from ...arrays import numpy_to_torch
    t = numpy_to_torch(np.ascontiguousarray(a))
    return t.to(like.device) if like.device.type != "cpu" else t


from ...dtypes import BFLOAT16 as _BF16  # noqa: E402


def _sig(arrays: list[np.ndarray]) -> tuple[tuple, tuple]:
    from ...dtypes import dtype_name
    return tuple(a.shape for a in arrays), tuple(
        a.dtype if isinstance(a, _NotATensor) else dtype_name(a.dtype) for a in arrays)


def _submit(kind: str, name: str | None, arrays: list[np.ndarray], run, op: str = "",
            root: int = -1) -> _core.Handle:
    j = _job(kind)
    shapes, dtypes = _sig(arrays)
    req = _core.Request(kind, j.engine.name(kind, name), shapes, dtypes, op, root, run)
    bad = [a for a in arrays if isinstance(a, _NotATensor)]
    if bad:
        _refuse(j, req, bad[0])
    return j.engine.submit(req)


def _refuse(j: _core.Job, req: _core.Request, bad: _NotATensor) -> None:
    """``req`` has an argument that is not a tensor: submit it all the same, so that the
    other ranks get a HorovodMismatchError naming this rank instead of waiting for it,
    then raise a TypeError here (Horovod fails on this rank, at the call)."""
    req.run = lambda: None  # never runs: the name's comparison fails on every rank
    try:
        j.engine.synchronize(j.engine.submit(req))
    except _core.HorovodMismatchError:
        pass
    raise TypeError(f"{req.kind} on rank {j.rank}: expected a torch.Tensor, got {bad.type} "
                    f"(submitted as {req.name!r}: the other ranks get a mismatch error)")


def _compress(compression: Any, tensor: Any) -> tuple[Any, Any]:
    """``compression.compress(tensor)``; what is not a tensor goes on as it is (refused)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor, None
    return compression.compress(tensor)


def poll(handle: _core.Handle) -> bool:
    """Whether ``handle``'s collective has run (a pending one takes part in one round
    of negotiation with the other ranks, which waits for them)."""
    return _job("poll").engine.poll(handle)


def synchronize(handle: _core.Handle) -> Any:
    """Wait for ``handle``'s collective; return its output."""
    return _job("synchronize").engine.synchronize(handle)


def _async_apis(start: Callable[..., _core.Handle], where: str, first: str, doc: str,
                doc_inplace: str) -> tuple[Callable[..., _core.Handle], ...]:
    """The public ``where`` and ``where_`` (in place): Horovod's arguments, checked, then
    ``start`` (``_allreduce_async`` or ``_grouped_async``). ``first``: the name Horovod
    gives the first argument (``tensor`` or ``tensors``)."""
    return (_async_api(start, where, first, False, doc),
            _async_api(start, where + "_", first, True, doc_inplace))


def _async_api(start: Callable[..., _core.Handle], where: str, first: str, inplace: bool,
               doc: str) -> Callable[..., _core.Handle]:

    def call(tensor, average=None, name=None, op=None, prescale_factor=1.0,
             postscale_factor=1.0, process_set=global_process_set):
        op = _core.op_from_average(op, average, where)
        return start(tensor, inplace, name, op, prescale_factor, postscale_factor,
                     process_set, where)

    # Callers may pass the first argument by Horovod's keyword: give the parameter its name.
    code = call.__code__
    call.__code__ = code.replace(co_varnames=(first,) + code.co_varnames[1:])
    call.__name__ = call.__qualname__ = where
    call.__doc__ = doc
    return call


# -- allreduce
def _allreduce_async(tensor, inplace, name, op, prescale_factor, postscale_factor,
                     process_set, where):
    _core.check_process_set(process_set, where)
    x = _np(tensor, where)
    comm = _job(where).comm

    def run():
        y = _core.np_allreduce(comm, x, op, prescale_factor, postscale_factor,
                               inplace=inplace and tensor.device.type == "cpu")
        if inplace:
            if tensor.device.type != "cpu":
                tensor.data.copy_(_tensor(y, tensor))
            return tensor
        return _tensor(y, tensor)
    return _submit("allreduce", name, [x], run, op)


allreduce_async, allreduce_async_ = _async_apis(
    _allreduce_async, "allreduce_async", "tensor",
    "Start an allreduce (default op Average); ``synchronize`` returns a new tensor.",
    "Start an in-place allreduce; ``synchronize`` returns ``tensor``, reduced.")


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.args = (op, prescale_factor, postscale_factor)
        return synchronize(_allreduce_async(tensor, False, name, op, prescale_factor,
                                            postscale_factor, None, "allreduce"))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post = ctx.args
        return synchronize(_allreduce_async(grad.contiguous(), False, None, op, pre, post, None,
                                            "allreduce")), None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over all ranks (default: average); a new tensor, differentiable."""
    op = _core.op_from_average(op, average, "allreduce")
    _core.check_process_set(process_set, "allreduce")
    compressed, cctx = _compress(compression, tensor)
    if getattr(compressed, "requires_grad", False) and op in (Average, Sum):
        out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor)
    else:
        out = synchronize(_allreduce_async(compressed, False, name, op, prescale_factor,
                                           postscale_factor, None, "allreduce"))
    return compression.decompress(out, cctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` in place; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


# -- grouped allreduce
def _grouped_async(tensors, inplace, name, op, prescale_factor, postscale_factor,
                   process_set, where):
    _core.check_process_set(process_set, where)
    tensors = list(tensors)
    xs = [_np(t, where) for t in tensors]
    comm = _job(where).comm

    def run():
        plain = prescale_factor == 1.0 and postscale_factor == 1.0 and not (
            op == Average and any(x.dtype.kind in "iub" for x in xs))
        if plain and not any(x.dtype == _BF16 for x in xs):
            ys = [x if inplace and t.device.type == "cpu" else x.copy()
                  for x, t in zip(xs, tensors)]
            comm.grouped_allreduce(ys, op=op)
        else:
            ys = [_core.np_allreduce(comm, x, op, prescale_factor, postscale_factor,
                                     inplace=inplace and t.device.type == "cpu")
                  for x, t in zip(xs, tensors)]
        if inplace:
            for y, t in zip(ys, tensors):
                if t.device.type != "cpu":
                    t.data.copy_(_tensor(y, t))
            return tensors
        return [_tensor(y, t) for y, t in zip(ys, tensors)]
    return _submit("grouped_allreduce", name, xs, run, op)


grouped_allreduce_async, grouped_allreduce_async_ = _async_apis(
    _grouped_async, "grouped_allreduce_async", "tensors",
    "Start a grouped allreduce; ``synchronize`` returns a list of new tensors.",
    "Start an in-place grouped allreduce; ``synchronize`` returns ``tensors``, reduced.")


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Allreduce a list of tensors as one fused operation; a list of new tensors."""
    op = _core.op_from_average(op, average, "grouped_allreduce")
    pairs = [_compress(compression, t) for t in tensors]
    outs = synchronize(_grouped_async([p[0] for p in pairs], False, name, op, prescale_factor,
                                      postscale_factor, process_set, "grouped_allreduce"))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather
def allgather_async(tensor, name=None, process_set=global_process_set):
    _core.check_process_set(process_set, "allgather_async")
    x = _np(tensor, "allgather_async")
    comm = _job("allgather").comm
    return _submit("allgather", name, [x],
                   lambda: _tensor(_core.np_allgather(comm, x), tensor))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx, grad):
        # d(out)/d(x) for this rank's rows: the sum over ranks of their output gradients.
        summed = allreduce(grad.contiguous(), op=Sum)
        counts = allgather_object(ctx.rows)
        start = sum(counts[:rank()])
        return summed[start:start + ctx.rows], None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension (its length may
    differ per rank; the other dimensions must match: checked, naming the rank)."""
    _core.check_process_set(process_set, "allgather")
    if getattr(tensor, "requires_grad", False):
        return _Allgather.apply(tensor, name)
    return synchronize(allgather_async(tensor, name))


# -- broadcast
def _broadcast_async(tensor, root_rank, name, inplace, process_set, where):
    _core.check_process_set(process_set, where)
    x = _np(tensor, where)
    j = _job(where)
    if not 0 <= int(root_rank) < j.size:
        raise ValueError(f"{where}: root_rank {root_rank} is not a rank of this job "
                         f"(0..{j.size - 1})")

    def run():
        cpu_inplace = inplace and tensor.device.type == "cpu"
        y = x if cpu_inplace else x.copy()
        j.comm.broadcast(_core.bits(y), root=int(root_rank), inplace=True)
        if inplace:
            if not cpu_inplace:
                tensor.data.copy_(_tensor(y, tensor))
            return tensor
        return _tensor(y, tensor)
    return _submit("broadcast", name, [x], run, root=int(root_rank))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return _broadcast_async(tensor, root_rank, name, False, process_set, "broadcast_async")


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return _broadcast_async(tensor, root_rank, name, True, process_set, "broadcast_async_")


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Root's ``tensor`` on every rank (a new tensor)."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with root's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall and reducescatter
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    _core.check_process_set(process_set, "alltoall_async")
    x = _np(tensor, "alltoall_async")
    sp = None if splits is None else np.asarray(
        splits.cpu().numpy() if isinstance(splits, torch.Tensor) else splits, dtype=np.int64)
    comm = _job("alltoall").comm

    def run():
        out, received = _core.np_alltoall(comm, x, sp)
        return _tensor(out, tensor), torch.from_numpy(received.astype(np.int32))
    return _submit("alltoall", name, [x], run)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rank i sends rows ``splits[j]`` of ``tensor`` to rank j (default: equal parts).
    Returns the received rows, and with ``splits`` also the rows received from each rank."""
    out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, received)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    _core.check_process_set(process_set, "reducescatter_async")
    op = _core.check_op(op, "reducescatter", (Average, Sum, Min, Max, Product))
    x = _np(tensor, "reducescatter_async")
    comm = _job("reducescatter").comm
    return _submit("reducescatter", name, [x], lambda: _tensor(
        _core.np_reducescatter(comm, x, op, prescale_factor, postscale_factor), tensor), op)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over ranks (default: average), then rank r keeps its share of the first
    dimension (the first ``n % size`` ranks get one row more)."""
    compressed, cctx = _compress(compression, tensor)
    out = synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                          postscale_factor))
    return compression.decompress(out, cctx)


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the other ranks' allreduces and
    broadcasts with zeros until every rank has joined. Returns the rank that joined last.

    Covers the hvd collectives (as Horovod's, not allgather/alltoall/reducescatter). A
    ``DistributedOptimizer`` step on another rank waits for this rank instead: give every
    rank the same number of steps (``collectives.dp.shard`` does).
    """
    return _job("join").engine.join()


# ----------------------------------------------------------------------------- objects
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set=global_process_set) -> Any:
    """Root's picklable ``obj`` on every rank."""
    _core.check_process_set(process_set, "broadcast_object")
    return _core.broadcast_object(obj, root_rank, name)


def allgather_object(obj: Any, name: str | None = None, process_set=global_process_set) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    _core.check_process_set(process_set, "allgather_object")
    return _core.allgather_object(obj, name)


# ----------------------------------------------------------------------------- model state
def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every rank's ``params`` with root's, in place: ``model.state_dict()``,
    ``model.named_parameters()``, ``model.parameters()`` or a list/dict of tensors.
    Names and shapes must match on every rank (checked, naming the rank)."""
    import dtrun.collectives.dp as dp
    _job("broadcast_parameters")
    if isinstance(params, dict):
        params = sorted(params.items())  # Horovod matches a dict by its sorted names
    dp.broadcast_parameters(params, root=root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Any = None) -> None:
    """Give every rank root's optimizer state (moments, step counts, learning rates)."""
    import dtrun.collectives.dp as dp
    _job("broadcast_optimizer_state")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")  # as Horovod
    dp.broadcast_optimizer_state(optimizer, root=root_rank)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 (Horovod's name)
                         named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups=None, sparse_as_dense: bool = False,
                         process_set=global_process_set) -> torch.optim.Optimizer:
    """``collectives.dp.DistributedOptimizer`` with Horovod's arguments.

    Gradients are averaged (``op=Average``) or summed (``op=Sum``) over ranks in buckets
    overlapped with the backward pass. ``gradient_predivide_factor`` f divides each
    gradient by f before the sum and the sum by size/f after (op=Average only, as
    Horovod). ``groups``/``num_groups`` only regroup Horovod's fusion: dtrun buckets by
    size and the result is the same; ``HOROVOD_FUSION_THRESHOLD`` (bytes) sets the
    bucket size, as it sets Horovod's fusion buffer. Sparse gradients are reduced dense, whatever
    ``sparse_as_dense`` says (the values are the same; ``.grad`` comes back dense).
    """
    import dtrun.collectives.dp as dp
    _job("DistributedOptimizer")
    _core.check_process_set(process_set, "DistributedOptimizer")
    op = _core.check_op(op, "DistributedOptimizer", (Average, Sum))
    f = float(gradient_predivide_factor)
    if f != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if f <= 0:
        raise ValueError("gradient_predivide_factor must be > 0")
    wire = Compression.to_dp(compression)
    extra = {}
    fusion = os.environ.get("HOROVOD_FUSION_THRESHOLD", "").strip()
    if fusion:  # Horovod's fusion buffer size: here, the bytes per gradient bucket
        if not fusion.isdigit() or int(fusion) < 1:
            raise ValueError(f"HOROVOD_FUSION_THRESHOLD={fusion!r}: expected a number of bytes")
        extra["bucket_bytes"] = int(fusion)
    dist = dp.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                   op=dp.AVG if op == Average else dp.SUM,
                                   backward_passes_per_step=backward_passes_per_step,
                                   compression=wire, **extra)
    if f != 1.0 and size() > 1:
        _predivide(dist, f)
    return dist


def _predivide(dist: Any, f: float) -> None:
    """Horovod's gradient_predivide_factor on collectives.dp's optimizer: each gradient is
    divided by f as it enters its bucket, and the averaged result multiplied by f."""
    fill, sync = dist._dp_fill, dist.synchronize

    def prescaled_fill(slot):
        fill(slot)
        b = slot.bucket
        b.flat[slot.offset:slot.offset + slot.numel].mul_(1.0 / f)

    def postscaled_synchronize():
        sync()
        with torch.no_grad():
            for s in dist._dp_slots:
                if s.param.grad is not None:
                    s.param.grad.mul_(f)

    dist._dp_fill = prescaled_fill
    dist.synchronize = postscaled_synchronize
