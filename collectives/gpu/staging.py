"""Path 3: copy device arrays to pinned host memory, run the host path, copy back."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..array_kinds import torch_to_numpy
from .context import GpuContext
from .device_array import DeviceArray, cai_copy, empty_like, finish, is_device, to_device, view


def staged(comm, ctx: GpuContext, name: str, args: tuple, kwargs: dict) -> Any:
    """Run ``comm.<name>`` on pinned host copies of the device arrays; results go back."""
    slots = iter(range(1 << 30))
    fresh = name.startswith("i")  # in flight after we return: must not share the pool
    copies: list[tuple[DeviceArray, np.ndarray, Any]] = []  # (device array, host, torch view)

    def to_host(v):
        if not is_device(v):
            return v
        d = DeviceArray(v, name, comm.rank)
        buf = ctx.pinned(next(slots), d.nbytes, d.lib, fresh)
        if d.lib == "torch":
            import torch
            tv = buf[:d.nbytes].view(v.dtype).view(d.shape) if d.nbytes else \
                torch.empty(d.shape, dtype=v.dtype, pin_memory=True)
            tv.copy_(v)  # ordered after queued work on the current stream; blocking
            host = torch_to_numpy(tv, name, comm.rank)
        else:
            host = np.asarray(buf[:d.nbytes]).view(d.dtype).reshape(d.shape)
            v.get(out=host) if hasattr(v, "get") else cai_copy(host, v)
        copies.append((d, host, None))
        return host

    new_args = tuple([to_host(a) for a in v] if isinstance(v, list) else to_host(v)
                     for v in args)
    new_kwargs = {k: to_host(v) for k, v in kwargs.items()}
    if name == "grouped_allreduce":
        new_kwargs["_cache"] = False  # host views are new objects every call
    result = getattr(comm, name)(*new_args, **new_kwargs)
    template = copies[0][0]

    def back(r):
        if isinstance(r, list):
            return [back(v) for v in r]
        if not isinstance(r, np.ndarray):
            return r
        for d, host, _ in copies:  # results that are (views of) a staged input: copy back
            base = host.ctypes.data
            if host.nbytes and base <= r.ctypes.data < base + host.nbytes or r is host:
                to_device(d, host)
                off = (r.ctypes.data - base) // d.dtype.itemsize
                return view(d, off, r.size, r.shape)
        dev = empty_like(template, r.shape)
        to_device(DeviceArray(dev, name, comm.rank), r)
        return dev

    return finish(result, back, (new_args, new_kwargs))
