"""What the paths need to know about one device array, and copies between device and host."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes as _dt
from ..array_kinds import DEVICE, classify, numpy_to_torch
from ..errors import DeviceError, NotContiguousError, UnsupportedDtypeError
from ..handle import Handle
from .discovery import cupy_cuda


class DeviceArray:
    """Pointer, shape, dtype and owning library of one torch/cupy/CAI device array."""

    __slots__ = ("obj", "lib", "ptr", "shape", "dtype", "size", "nbytes", "device")

    def __init__(self, obj: Any, op: str, rank: int) -> None:
        self.obj = obj
        mod = type(obj).__module__
        if mod.startswith("torch"):
            self.lib = "torch"
            if not obj.is_contiguous():
                raise NotContiguousError(op, rank, f"CUDA tensor of shape {tuple(obj.shape)} "
                                         "is not contiguous; pass t.contiguous()")
            self.dtype = _torch_dtype(obj.dtype, op, rank)
            self.ptr = obj.data_ptr()
            self.shape = tuple(obj.shape)
            self.device = obj.device.index
        else:
            cai = getattr(obj, "__cuda_array_interface__", None)
            if cai is None:
                raise DeviceError(op, rank, f"{type(obj).__name__} lives on a GPU but has no "
                                  "__cuda_array_interface__; pass a cupy array or torch tensor")
            self.lib = "cupy" if mod.startswith("cupy") else "cai"
            self.dtype = np.dtype(cai["typestr"])
            self.shape = tuple(cai["shape"])
            strides = cai.get("strides")
            if strides is not None and strides != _c_strides(self.shape, self.dtype.itemsize):
                raise NotContiguousError(op, rank, f"GPU array of shape {self.shape} with "
                                         f"strides {strides} is not C-contiguous")
            self.ptr = cai["data"][0]
            self.device = getattr(getattr(obj, "device", None), "id", None)
        if _dt.mpi_type(self.dtype) is None:
            raise UnsupportedDtypeError(op, rank, f"dtype {self.dtype} is not supported")
        self.size = int(np.prod(self.shape)) if self.shape else 1
        self.nbytes = self.size * self.dtype.itemsize


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


_TORCH_DTYPES: dict[Any, np.dtype] = {}


def _torch_dtype(tdtype: Any, op: str, rank: int) -> np.dtype:
    if not _TORCH_DTYPES:
        import torch
        _TORCH_DTYPES.update({
            torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
            torch.float16: np.dtype(np.float16), torch.bfloat16: _dt.BFLOAT16,
            torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16),
            torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
            torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_),
            torch.complex64: np.dtype(np.complex64), torch.complex128: np.dtype(np.complex128),
        })
    found = _TORCH_DTYPES.get(tdtype)
    if found is None:
        raise UnsupportedDtypeError(op, rank, f"tensor dtype {tdtype} is not supported")
    return found


def is_device(v: Any) -> bool:
    return classify(v) == DEVICE


def sync_stream(lib: str) -> None:
    """Wait for queued GPU work before MPI touches device memory (MPI knows no streams)."""
    if lib == "torch":
        import torch
        torch.cuda.current_stream().synchronize()
    else:
        cupy = cupy_cuda()
        if cupy is not None:
            cupy.cuda.get_current_stream().synchronize()


def stream_ptr(lib: str) -> int:
    """The current CUDA stream of ``lib`` as the raw pointer NCCL takes."""
    if lib == "torch":
        import torch
        return torch.cuda.current_stream().cuda_stream
    import cupy
    return cupy.cuda.get_current_stream().ptr


def empty_like(d: DeviceArray, shape: tuple) -> Any:
    """New device array of ``shape`` with the library, dtype and device of ``d``."""
    if d.lib == "torch":
        import torch
        return torch.empty(shape, dtype=d.obj.dtype, device=d.obj.device)
    import cupy
    if d.dtype == _dt.BFLOAT16:
        raise UnsupportedDtypeError("gpu", None, "bfloat16 cupy arrays are not supported")
    with cupy.cuda.Device(d.device if d.device is not None else cupy.cuda.Device().id):
        return cupy.empty(shape, dtype=d.dtype)


def cai_copy(host: np.ndarray, v: Any) -> None:
    """Copy a ``__cuda_array_interface__`` array into ``host``."""
    import cupy
    cupy.asarray(v).get(out=host)


def to_device(d: DeviceArray, host: np.ndarray) -> None:
    """Copy ``host`` (same size) into the device array of ``d``."""
    if d.nbytes == 0:
        return
    if d.lib == "torch":
        d.obj.copy_(numpy_to_torch(host).reshape(d.shape))
    else:
        import cupy
        cupy.asarray(d.obj).set(np.ascontiguousarray(host).reshape(d.shape))


def view(d: DeviceArray, offset: int, count: int, shape: tuple) -> Any:
    """View of ``count`` elements of ``d`` from element ``offset``, reshaped."""
    if offset == 0 and count == d.size and tuple(shape) == d.shape:
        return d.obj
    return d.obj.reshape(-1)[offset:offset + count].reshape(shape)


def finish(result: Any, back, keep) -> Any:
    """Map a result back to the caller's array type, now or, for a Handle, when it completes."""
    if isinstance(result, Handle):
        inner = result
        return Handle(inner, None, post=lambda _: back(inner.wait()), keep=keep, op=inner.op)
    return back(result)
