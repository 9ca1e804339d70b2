"""Path 1: collectives on the current CUDA stream through libnccl.

Each collective is one function in ``_OPS`` that takes a bound ``_Call`` (the arguments
by name plus what every NCCL call needs) and returns the result array. The blocking
and the non-blocking form (``allreduce``/``iallreduce``) share it: the non-blocking one
wraps the result in a Handle that completes with a CUDA event.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import dtypes as _dt
from ..errors import CollectiveError, UnsupportedDtypeError
from ..handle import Handle
from .context import GpuContext
from .device_array import DeviceArray, empty_like, stream_ptr, view
from .nccl_lib import NCCL_DTYPE, NCCL_OP
from .signatures import bind


class _EventRequest:
    """Completion of stream-ordered NCCL work, with MPI.Request's Wait/Test."""

    def __init__(self, lib: str) -> None:
        if lib == "torch":
            import torch
            self.event = torch.cuda.Event()
            self.event.record()
            self._query = self.event.query
        else:
            import cupy
            self.event = cupy.cuda.Event()
            self.event.record()
            self._query = lambda: self.event.done
        self._sync = self.event.synchronize

    def Wait(self) -> None:  # noqa: N802
        self._sync()

    def Test(self) -> bool:  # noqa: N802
        return bool(self._query())


class _Call:
    """One NCCL collective: its arguments by name and the handles every NCCL call takes."""

    def __init__(self, comm, ctx: GpuContext, name: str, args: tuple, kwargs: dict) -> None:
        self.name = name
        self.base = name[1:] if name.startswith("i") else name
        self.values = bind(self.base, args, kwargs)
        self.x = x = DeviceArray(self.values["x"], name, comm.rank)
        self.size, self.rank = comm.size, comm.rank
        self.lib, self.nc, self.stream = ctx.nccl.lib, ctx.nccl_comm, stream_ptr(x.lib)
        self.dt = NCCL_DTYPE[x.dtype]
        op_name = _dt.OP_ALIASES.get(str(self.values.get("op", "sum")).lower(), "sum")
        self.nop = NCCL_OP[op_name]
        if op_name == _dt.AVG and x.dtype.kind not in "f" and x.dtype != _dt.BFLOAT16:
            raise UnsupportedDtypeError(name, comm.rank, _dt.reduce_problem(x.dtype, _dt.AVG))
        self._check = ctx.nccl.check
        self.inplace = self.values.get("inplace", False)
        self.out_obj = self.values.get("out")

    @property
    def writes_input(self) -> bool:
        """The result goes into ``x`` itself (``inplace=True`` or ``out=x``)."""
        return bool(self.inplace) or self.out_obj is self.values["x"]

    @property
    def per_rank(self) -> int:
        """Elements of ``x`` that belong to each rank (scatter/gather-like ops)."""
        return self.x.size // self.size

    def check(self, status: int) -> None:
        self._check(status, self.base)

    def rows(self) -> int:
        """Rows of axis 0 per rank; an axis that the ranks cannot split evenly is an error."""
        x = self.x
        n = x.shape[0] if x.shape else 1
        if n % self.size:
            raise CollectiveError(self.base, self.rank, f"axis 0 has length {n}, which "
                                  f"{self.size} ranks cannot split evenly")
        return n // self.size

    def out_for(self, shape: tuple) -> DeviceArray:
        """Where the result of ``shape`` goes: ``x``, the caller's ``out``, or a new array."""
        x = self.x
        if self.writes_input:
            return x
        if self.out_obj is None:
            return DeviceArray(empty_like(x, shape), self.name, self.rank)
        o = DeviceArray(self.out_obj, self.name, self.rank)
        if o.shape != tuple(shape) or o.dtype != x.dtype:
            raise CollectiveError(self.base, self.rank, f"out has shape {o.shape} dtype "
                                  f"{o.dtype}, expected {tuple(shape)} {x.dtype}")
        return o


def _allreduce(c: _Call) -> Any:
    x, o = c.x, c.out_for(c.x.shape)
    c.check(c.lib.ncclAllReduce(x.ptr, o.ptr, x.size, c.dt, c.nop, c.nc, c.stream))
    return o.obj


def _reduce(c: _Call) -> Any:
    x, root = c.x, c.values["root"]
    o = c.out_for(x.shape) if c.rank == root else x
    c.check(c.lib.ncclReduce(x.ptr, o.ptr, x.size, c.dt, c.nop, root, c.nc, c.stream))
    return o.obj if c.rank == root else None


def _broadcast(c: _Call) -> Any:
    x, o = c.x, c.out_for(c.x.shape)
    c.check(c.lib.ncclBroadcast(x.ptr, o.ptr, x.size, c.dt, c.values["root"], c.nc,
                                c.stream))
    return o.obj


def _allgather(c: _Call) -> Any:
    x = c.x
    if c.writes_input:
        c.rows()
        per = c.per_rank
        c.check(c.lib.ncclAllGather(x.ptr + c.rank * per * x.dtype.itemsize, x.ptr, per,
                                    c.dt, c.nc, c.stream))
        return x.obj
    o = c.out_for(((x.shape[0] if x.shape else 1) * c.size,) + x.shape[1:])
    c.check(c.lib.ncclAllGather(x.ptr, o.ptr, x.size, c.dt, c.nc, c.stream))
    return o.obj


def _reduce_scatter(c: _Call) -> Any:
    x = c.x
    shape = (c.rows(),) + x.shape[1:]
    per = c.per_rank
    if not c.inplace:
        o = c.out_for(shape)
        c.check(c.lib.ncclReduceScatter(x.ptr, o.ptr, per, c.dt, c.nop, c.nc, c.stream))
        return o.obj
    # NCCL's in-place form puts rank i's part at offset i; ours (like MPI's IN_PLACE)
    # at offset 0: reduce into offset i, then move it to the front.
    off = x.ptr + c.rank * per * x.dtype.itemsize
    c.check(c.lib.ncclReduceScatter(x.ptr, off, per, c.dt, c.nop, c.nc, c.stream))
    flat = x.obj.reshape(-1)
    mine = flat[c.rank * per:(c.rank + 1) * per]
    flat[:per] = mine.clone() if x.lib == "torch" else mine.copy()
    return view(x, 0, per, shape)


def _alltoall(c: _Call) -> Any:
    x = c.x
    c.rows()
    per = c.per_rank
    nb = per * x.dtype.itemsize
    # NCCL has no in-place all-to-all: exchange into a scratch array, then copy back.
    o = DeviceArray(empty_like(x, x.shape), c.name, c.rank) if c.writes_input \
        else c.out_for(x.shape)
    c.check(c.lib.ncclGroupStart())
    for peer in range(c.size):
        c.check(c.lib.ncclSend(x.ptr + peer * nb, per, c.dt, peer, c.nc, c.stream))
        c.check(c.lib.ncclRecv(o.ptr + peer * nb, per, c.dt, peer, c.nc, c.stream))
    c.check(c.lib.ncclGroupEnd())
    if not c.writes_input:
        return o.obj
    x.obj.copy_(o.obj) if x.lib == "torch" else x.obj.__setitem__(Ellipsis, o.obj)
    return x.obj


_OPS: dict[str, Callable[[_Call], Any]] = {
    "allreduce": _allreduce, "reduce": _reduce, "broadcast": _broadcast,
    "allgather": _allgather, "reduce_scatter": _reduce_scatter, "alltoall": _alltoall,
}
NCCL_OPS = tuple(_OPS) + tuple("i" + name for name in _OPS)


def nccl_call(comm, ctx: GpuContext, name: str, args: tuple, kwargs: dict) -> Any:
    """Run collective ``name`` (or its ``i…`` form) through NCCL on the current stream."""
    c = _Call(comm, ctx, name, args, kwargs)
    impl = _OPS.get(c.base)
    if impl is None:
        raise CollectiveError(name, comm.rank, "no NCCL implementation")
    result = impl(c)
    if c.base == name:
        return result
    return Handle(_EventRequest(c.x.lib), result, keep=c.values["x"], op=name)


def nccl_grouped(comm, ctx: GpuContext, arrays: list, op: str) -> list:
    """Fused allreduce on GPU: NCCL group calls (NCCL fuses them itself)."""
    lib, nc = ctx.nccl.lib, ctx.nccl_comm
    canon = _dt.OP_ALIASES.get(str(op).lower(), "sum")
    devs = [DeviceArray(a, "grouped_allreduce", comm.rank) for a in arrays]
    stream = stream_ptr(devs[0].lib)
    ctx.nccl.check(lib.ncclGroupStart(), "grouped_allreduce")
    for d in devs:
        ctx.nccl.check(lib.ncclAllReduce(d.ptr, d.ptr, d.size, NCCL_DTYPE[d.dtype],
                                         NCCL_OP[canon], nc, stream), "grouped_allreduce")
    ctx.nccl.check(lib.ncclGroupEnd(), "grouped_allreduce")
    return list(arrays)
