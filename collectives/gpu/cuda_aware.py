"""Path 2: device pointers straight to a CUDA-aware MPI, through cupy views of the arrays."""

from __future__ import annotations

from typing import Any

from .._mpi import MPI
from ..dtypes import mpi_type

from ..handle import Handle
from .context import GpuContext
from .device_array import DeviceArray, finish, is_device, sync_stream
from .signatures import CORE_SIGNATURES, P2P, bind
from .staging import staged


def cuda_aware(comm, ctx: GpuContext, name: str, args: tuple, kwargs: dict) -> Any:
    """Run ``comm.<name>`` on cupy views of the device arrays (the MPI library reads them)."""
    if name not in CORE_SIGNATURES and name not in P2P and name != "grouped_allreduce":
        return staged(comm, ctx, name, args, kwargs)  # e.g. ibroadcast: no device core
    cupy = ctx.cupy
    originals: dict[int, Any] = {}
    libs = set()

    def conv(v):
        if not is_device(v):
            return v
        d = DeviceArray(v, name, comm.rank)
        libs.add(d.lib)
        c = v if d.lib == "cupy" else cupy.asarray(v)  # zero-copy via the CAI
        originals[id(c)] = v
        return c

    new_args = tuple([conv(a) for a in v] if isinstance(v, list) else conv(v) for v in args)
    new_kwargs = {k: conv(v) for k, v in kwargs.items()}
    for lib in libs:
        sync_stream(lib)
    if name in P2P:
        result = _p2p_device(comm, name, new_args, new_kwargs)
    elif name == "grouped_allreduce":
        for a in new_args[0]:
            comm._allreduce(a, new_kwargs.get("op", "sum"), None, True, cupy)
        result = list(args[0])
    else:
        result = _call_core(comm, name, getattr(comm, "_" + name), new_args, new_kwargs, cupy)
    torch_in = "torch" in libs

    def back(r):
        if isinstance(r, list) or r is None or isinstance(r, (int, float)):
            return r
        orig = originals.get(id(r))
        if orig is not None:
            return orig
        if torch_in and isinstance(r, cupy.ndarray):
            import torch
            return torch.as_tensor(r, device=f"cuda:{r.device.id}")
        return r

    return finish(result, back, (new_args, new_kwargs))


def _p2p_device(comm, name, args, kwargs):
    """Point-to-point on device buffers: MPI gets the pointers, no host copy."""
    if name in ("send", "isend"):
        x, dest = args[0], args[1]
        tag = args[2] if len(args) > 2 else kwargs.get("tag", 0)
        t = mpi_type(x.dtype)
        if name == "send":
            comm.mpi.Send([x, t], dest, tag)
            return None
        return Handle(comm.mpi.Isend([x, t], dest, tag), None, keep=x, op="isend")
    if name in ("recv", "irecv"):
        out = args[0]
        source = args[1] if len(args) > 1 else kwargs.get("source", MPI.ANY_SOURCE)
        tag = args[2] if len(args) > 2 else kwargs.get("tag", MPI.ANY_TAG)
        t = mpi_type(out.dtype)
        if name == "recv":
            comm.mpi.Recv([out, t], source, tag)
            return out
        return Handle(comm.mpi.Irecv([out, t], source, tag), out, op="irecv")
    x, dest, out = args[0], args[1], args[2]
    source = args[3] if len(args) > 3 else kwargs.get("source", MPI.ANY_SOURCE)
    comm.mpi.Sendrecv([x, mpi_type(x.dtype)], dest, 0, [out, mpi_type(out.dtype)], source)
    return out


def _call_core(comm, name, impl, args, kwargs, xp):
    values = bind(name, args, kwargs)
    return impl(*[values[p] for p in CORE_SIGNATURES[name]], xp)
