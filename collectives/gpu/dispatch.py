"""Which path (nccl, cuda-aware, staging) each call on GPU arrays takes, and the call."""

from __future__ import annotations

from typing import Any

from .. import dtypes as _dt
from .context import GpuContext, context
from .cuda_aware import cuda_aware
from .device_array import DeviceArray, is_device
from .nccl_lib import NCCL_AVG_VERSION, NCCL_DTYPE, NCCL_OP
from .nccl_path import NCCL_OPS, nccl_call, nccl_grouped
from .staging import staged

_COLLECTIVE_OPS = NCCL_OPS + ("scatter", "gather", "gatherv", "allgatherv",
                              "grouped_allreduce")
_PATHS = {"nccl": nccl_call, "cuda-aware": cuda_aware, "staging": staged}

__all__ = ["NCCL_OPS", "dispatch", "gpu_path"]


def gpu_path(comm, name: str, x: Any, op: str | None = None) -> str:
    """Which path (nccl, cuda-aware, staging) ``comm.<name>(x)`` takes (collective the
    first time, when NCCL is set up)."""
    ctx = context(comm)
    d = DeviceArray(x, name, comm.rank)
    return _choose(ctx, name, d, op)


def _mpi_path(ctx: GpuContext, d: DeviceArray) -> str:
    """The better of the two MPI paths for ``d``."""
    if ctx.cuda_aware and ctx.cupy is not None and d.dtype != _dt.BFLOAT16:
        return "cuda-aware"
    return "staging"


def _choose(ctx: GpuContext, name: str, d: DeviceArray, op: str | None) -> str:
    if name in NCCL_OPS:
        if ctx.nccl is None and not ctx.nccl_error:
            ctx.setup_nccl(d)
        canon = _dt.OP_ALIASES.get(str(op).lower(), op) if op else None
        if (ctx.nccl is not None and d.dtype in NCCL_DTYPE
                and (canon is None or (canon in NCCL_OP and (
                    canon != _dt.AVG or ctx.nccl.version >= NCCL_AVG_VERSION)))):
            return "nccl"
    return _mpi_path(ctx, d)


def dispatch(comm, name: str, args: tuple, kwargs: dict) -> Any:
    """Run ``comm.<name>`` with GPU arrays among ``args``/``kwargs``."""
    ctx = context(comm)
    first = next((v for v in list(args) + list(kwargs.values()) if is_device(v)), None)
    if first is None and name == "grouped_allreduce":
        first = next(v for v in args[0] if is_device(v))
    d = DeviceArray(first, name, comm.rank)
    if name == "grouped_allreduce":
        path = _choose(ctx, "allreduce", d, kwargs.get("op", "sum"))
        if path == "nccl":
            return nccl_grouped(comm, ctx, args[0], kwargs.get("op", "sum"))
    elif name in _COLLECTIVE_OPS:
        path = _choose(ctx, name, d, kwargs.get("op"))
    else:  # point to point: never NCCL (its setup is collective)
        path = _mpi_path(ctx, d)
    return _PATHS[path](comm, ctx, name, args, kwargs)
