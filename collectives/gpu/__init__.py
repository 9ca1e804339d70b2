"""GPU arrays (CuPy, PyTorch CUDA, anything with ``__cuda_array_interface__``).

Nothing here is imported on a CPU-only run: ``collectives.arrays`` calls
``dispatch`` only when an argument lives on a GPU. cupy, torch and NCCL are optional;
each path needs only what it names.

Paths, tried in this order for each call (``gpu_path(comm, ...)`` reports the choice):

1. ``nccl`` -- allreduce, reduce, broadcast, allgather, reduce_scatter, alltoall on
   the current CUDA stream through libnccl (ctypes; found next to torch/cupy, the
   ``nvidia-nccl-cu*`` wheel, ``DTRUN_NCCL_LIB`` or the system). Used when every rank
   of the communicator agreed at setup that it can: NCCL loads, and no two ranks share
   a GPU (NCCL refuses duplicates). ``DTRUN_NCCL=0`` turns it off. Stream-ordered, as
   in torch.distributed: the result is ready for later work on the same stream.
2. ``cuda-aware`` -- device pointers straight to MPI, when the MPI library says it is
   CUDA-aware (``MPIX_Query_cuda_support``; ``DTRUN_CUDA_AWARE=0/1`` overrides) and
   cupy is installed (the operation code works on cupy views of the arrays, zero-copy
   for torch tensors). The current stream is synchronised first, since MPI does not
   know about streams.
3. ``staging`` -- copy to pinned host memory, run the host path (including the
   shared-memory allreduce), copy back. Always available.

Modules, one concept each:

* ``discovery`` -- which devices and libraries exist: ``device_count``,
  ``select_device``, ``describe_device``, ``cuda_aware_mpi``;
* ``device_array`` -- what a path needs to know about one device array, and the
  copies and views between device and host;
* ``nccl_lib`` -- the ctypes binding of libnccl (class ``Nccl``);
* ``context`` -- per-communicator state (class ``GpuContext``: the NCCL communicator,
  pinned buffers);
* ``nccl_path``, ``cuda_aware``, ``staging`` -- the three paths;
* ``dispatch`` -- the choice of path for each call (``dispatch``, ``gpu_path``).
"""

from __future__ import annotations

from .context import GpuContext, context
from .discovery import cuda_aware_mpi, describe_device, device_count, select_device
from .dispatch import NCCL_OPS, dispatch, gpu_path
from .nccl_lib import Nccl

__all__ = ["NCCL_OPS", "GpuContext", "Nccl", "context", "cuda_aware_mpi", "describe_device",
           "device_count", "dispatch", "gpu_path", "select_device"]
