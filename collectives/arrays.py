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

from . import dtypes as _dt
from .errors import NotContiguousError, UnsupportedDtypeError
from .handle import Handle

NUMPY, TORCH_CPU, DEVICE, OTHER = "numpy", "torch", "device", "other"
_DLPACK_CUDA = (2, 3, 13)  # kDLCUDA, kDLCUDAHost (pinned: treat as device), kDLCUDAManaged


def classify(obj: Any) -> str | None:
    """Kind of array ``obj`` is: numpy, torch (CPU), device (GPU), other; None if not
    an array-like argument at all (ints, strings, None)."""
    if obj is None or isinstance(obj, (int, float, str, bool)):
        return None
    if isinstance(obj, np.ndarray):
        return NUMPY
    mod = type(obj).__module__
    if mod.startswith("torch"):
        return DEVICE if getattr(obj, "is_cuda", False) else TORCH_CPU
    if hasattr(obj, "__cuda_array_interface__"):
        return DEVICE
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            if dev()[0] in _DLPACK_CUDA:
                return DEVICE
        except Exception:
            pass
    return OTHER


def torch_to_numpy(t: Any, op: str, rank: int) -> np.ndarray:
    """Zero-copy NumPy view of a CPU tensor (bfloat16 as 16-bit storage)."""
    import torch

    if not t.is_contiguous():
        raise NotContiguousError(op, rank, f"tensor of shape {tuple(t.shape)} with stride "
                                 f"{t.stride()} is not contiguous; pass t.contiguous()")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_dt.BFLOAT16)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as e:
        raise UnsupportedDtypeError(op, rank, f"tensor dtype {t.dtype} is not supported "
                                    f"({e}); use one of {', '.join(_dt.supported_dtypes())}") from None


def numpy_to_torch(a: np.ndarray) -> Any:
    """Tensor sharing memory with ``a`` (bfloat16 restored)."""
    import torch

    if a.dtype == _dt.BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


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
        from . import gpu
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
