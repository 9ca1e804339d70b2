"""What kind of array an argument is, and zero-copy views of PyTorch CPU tensors.

The bottom of the array adapters: ``arrays`` (CPU dispatch) and ``gpu`` both use it,
and it imports neither. torch is imported only to convert a tensor the caller passed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import dtypes as _dt
from .errors import NotContiguousError, UnsupportedDtypeError

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
