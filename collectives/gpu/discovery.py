"""Which CUDA devices and libraries this process can use, and whether MPI is CUDA-aware."""

from __future__ import annotations

import ctypes
import os

from .._mpi import MPI

from ..env import env_local_rank
from ..errors import DeviceError


def loaded_library(fragment: str) -> str | None:
    """Path of an already loaded shared library whose name contains ``fragment``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if fragment in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def cuda_aware_mpi() -> bool | None:
    """Whether MPI accepts CUDA device pointers: True, False, or None (cannot tell).

    mpi4py 4.1 does not wrap Open MPI's ``MPIX_Query_cuda_support()`` extension (it
    only uses it internally), so when ``MPI.Query_cuda_support`` is absent the C symbol
    is called through ctypes from the libmpi this process has loaded. Open MPI exports
    it in every build (returning 0 without CUDA). ``DTRUN_CUDA_AWARE=0|1`` overrides.
    """
    forced = os.environ.get("DTRUN_CUDA_AWARE", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        return bool(query())
    path = loaded_library("libmpi.so") or loaded_library("libmpi_")
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None  # e.g. MPICH: no such extension
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return bool(fn())


def torch_cuda():
    """The torch module when it has CUDA, else None."""
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def cupy_cuda():
    """The cupy module when it finds the CUDA runtime, else None."""
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:
        return None


def device_count() -> int:
    """CUDA devices visible to this process (0 without torch/cupy or a GPU)."""
    torch = torch_cuda()
    if torch is not None:
        return torch.cuda.device_count()
    cupy = cupy_cuda()
    if cupy is not None:
        return cupy.cuda.runtime.getDeviceCount()
    return 0


def select_device(local_rank: int | None = None) -> int:
    """Make ``local_rank % device_count`` the current device (torch and cupy).

    Call before creating GPU arrays. ``local_rank`` defaults to the launcher's
    environment (DTRUN_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, ...), since this is
    typically done before MPI is up.

    Raises:
        DeviceError: no CUDA device is visible.
    """
    n = device_count()
    if n == 0:
        raise DeviceError("select_device", None, "no CUDA device visible (no GPU, no "
                          "CUDA build of torch/cupy, or CUDA_VISIBLE_DEVICES is empty)")
    dev = (env_local_rank() if local_rank is None else local_rank) % n
    torch = torch_cuda()
    if torch is not None:
        torch.cuda.set_device(dev)
    cupy = cupy_cuda()
    if cupy is not None:
        cupy.cuda.Device(dev).use()
    return dev


def describe_device() -> str:
    """Short name of the current device, e.g. ``cuda:0 NVIDIA H100 80GB HBM3``."""
    torch = torch_cuda()
    if torch is not None:
        d = torch.cuda.current_device()
        return f"cuda:{d} {torch.cuda.get_device_name(d)}"
    cupy = cupy_cuda()
    if cupy is not None:
        d = cupy.cuda.Device().id
        name = cupy.cuda.runtime.getDeviceProperties(d)["name"]
        return f"cuda:{d} {name.decode() if isinstance(name, bytes) else name}"
    return "cpu"
