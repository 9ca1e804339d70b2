"""Adapters for arrays that are not plain NumPy: PyTorch CPU tensors, GPU arrays.

PyTorch CPU tensors are viewed as NumPy arrays without copying (``tensor.numpy()``;
bfloat16, which NumPy lacks, is viewed as 16-bit storage and reduced by our own
kernels) and results are handed back as tensors sharing that memory. Arrays on a GPU
(CuPy, PyTorch CUDA, anything with ``__cuda_array_interface__`` or a CUDA DLPack
device) are passed to ``collectives.gpu``. torch and cupy are never imported here
unless the caller already passed one of their arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .array_kinds import DEVICE, NUMPY, OTHER, TORCH_CPU, classify, numpy_to_torch, torch_to_numpy
from .errors import UnsupportedDtypeError
from .handle import Handle

__all__ = ["DEVICE", "NUMPY", "OTHER", "TORCH_CPU", "classify", "dispatch", "numpy_to_torch",
           "torch_to_numpy"]

def _wrong_type(comm, name: str, obj: Any) -> UnsupportedDtypeError:
    return UnsupportedDtypeError(
        name, comm.rank, f"expected a NumPy array, PyTorch tensor or GPU array, got "
        f"{type(obj).__module__}.{type(obj).__name__}; wrap it with np.asarray(...)")


def dispatch(comm, name: str, args: tuple, kwargs: dict) -> Any:
    """Run ``comm.<name>`` on arguments that are not all plain NumPy arrays."""
    values = list(args) + [kwargs.get("out")]
    flat = []
    for v in values:
        if isinstance(v, (list, tuple)) and name == "grouped_allreduce":
            flat.extend(v)
        else:
            flat.append(v)
    kinds = {classify(v) for v in flat} - {None}
    if DEVICE in kinds:
        from . import gpu  # lazy: the GPU package, only for a device array
        return gpu.dispatch(comm, name, args, kwargs)
    if OTHER in kinds:
        bad = next(v for v in flat if classify(v) == OTHER)
        raise _wrong_type(comm, name, bad)
    if TORCH_CPU not in kinds:
        # NumPy subclasses (np.matrix, memmap): operate on a base-class view.
        conv = lambda v: np.asarray(v) if isinstance(v, np.ndarray) else v  # noqa: E731
        args = tuple([conv(a) for a in v] if isinstance(v, list) else conv(v) for v in args)
        kwargs = {k: conv(v) for k, v in kwargs.items()}
        return getattr(comm, name)(*args, **kwargs)
    return _torch_cpu(comm, name, args, kwargs)


def _torch_cpu(comm, name: str, args: tuple, kwargs: dict) -> Any:
    originals: dict[int, Any] = {}  # id(numpy view) -> original tensor

    def conv(v):
        if classify(v) == TORCH_CPU:
            a = torch_to_numpy(v, name, comm.rank)
            originals[id(a)] = v
            return a
        if isinstance(v, np.ndarray):
            return np.asarray(v)
        return v

    new_args = tuple([conv(a) for a in v] if isinstance(v, list) else conv(v) for v in args)
    new_kwargs = {k: conv(v) for k, v in kwargs.items()}
    keep = (new_args, new_kwargs)  # the views must outlive the call

    def back(r):
        if isinstance(r, np.ndarray):
            orig = originals.get(id(r))
            return orig if orig is not None else numpy_to_torch(r)
        if isinstance(r, list):
            return [back(v) for v in r]
        return r

    if name == "grouped_allreduce":
        # Views are new objects each call, and a tensor's storage can move (resize_,
        # set_): never cache a fused plan keyed by them.
        new_kwargs["_cache"] = False
    result = getattr(comm, name)(*new_args, **new_kwargs)
    if isinstance(result, Handle):
        inner = result
        return Handle(inner, None, post=lambda _: back(inner.wait()), keep=keep, op=inner.op)
    return back(result)
