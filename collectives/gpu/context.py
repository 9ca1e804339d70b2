"""Per-communicator GPU state: the NCCL communicator, agreed on by all ranks, and pinned buffers."""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np

from ..errors import CollectiveError, DeviceError
from .device_array import DeviceArray
from .discovery import cuda_aware_mpi, cupy_cuda
from .nccl_lib import Nccl


class GpuContext:
    """Per-communicator GPU state, created at the first collective on GPU arrays
    (collective itself: all ranks agree on NCCL there)."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.cuda_aware = bool(cuda_aware_mpi())
        self.cupy = cupy_cuda()
        self.nccl: Nccl | None = None
        self.nccl_comm = None
        self.nccl_error = ""
        self._pinned: dict[tuple[str, int], Any] = {}

    def setup_nccl(self, d: DeviceArray) -> None:
        """Collective: decide on all ranks together whether NCCL is usable."""
        ok, why, lib = 1, "", None
        if os.environ.get("DTRUN_NCCL", "1").strip() == "0":
            ok, why = 0, "DTRUN_NCCL=0"
        else:
            try:
                lib = Nccl()
            except (OSError, AttributeError, CollectiveError) as e:
                ok, why = 0, f"libnccl not loadable ({e})"
        # Stable across processes (str hash() is salted per process).
        ident = zlib.crc32(f"{self.comm.host}|{_pci_id(d)}".encode())
        table = np.empty((self.comm.size, 2), dtype=np.int64)
        self.comm.mpi.Allgather(np.array([ok, ident], dtype=np.int64), table)
        if len(set(table[:, 1].tolist())) < self.comm.size:
            ok, why = 0, "two ranks share a GPU (NCCL needs one GPU per rank)"
        if not table[:, 0].all() and ok:
            ok, why = 0, "NCCL unavailable on some rank"
        if not ok:
            self.nccl_error = why
            self.nccl = None
            return
        uid = np.frombuffer(lib.unique_id() if self.comm.rank == 0 else bytes(128),
                            dtype=np.uint8).copy()
        self.comm.mpi.Bcast(uid, root=0)
        lib.rank = self.comm.rank
        try:
            self.nccl_comm = lib.init_rank(self.comm.size, uid.tobytes(), self.comm.rank)
        except CollectiveError as e:
            self.nccl_error = f"ncclCommInitRank failed: {e.problem}"
            raise DeviceError("nccl setup", self.comm.rank, f"{e.problem}; set DTRUN_NCCL=0 to "
                              "move GPU arrays through MPI instead, NCCL_DEBUG=INFO to see "
                              "why") from None
        self.nccl = lib

    def pinned(self, slot: int, nbytes: int, lib: str, fresh: bool = False) -> Any:
        """Reusable page-locked host buffer (uint8) of at least ``nbytes``; ``fresh``
        gives a new one that the pool does not keep (for operations left in flight)."""
        key = (lib, slot)
        buf = None if fresh else self._pinned.get(key)
        if buf is None or buf.nbytes < nbytes:
            size = max(nbytes, 1 << 20)
            if lib == "torch":
                import torch
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            elif self.cupy is not None:
                import cupyx
                buf = cupyx.empty_pinned(size, dtype=np.uint8)
            else:
                buf = np.empty(size, dtype=np.uint8)
            if not fresh:
                self._pinned[key] = buf
        return buf

    def free(self) -> None:
        if self.nccl is not None and self.nccl_comm is not None:
            self.nccl.lib.ncclCommDestroy(self.nccl_comm)
            self.nccl_comm = None


def _pci_id(d: DeviceArray) -> str:
    try:
        if d.lib == "torch":
            import torch
            p = torch.cuda.get_device_properties(d.device)
            return f"{getattr(p, 'pci_domain_id', 0)}:{p.pci_bus_id}:{p.pci_device_id}"
        import cupy
        return cupy.cuda.Device(d.device).pci_bus_id
    except Exception:
        return str(d.device)


def context(comm) -> GpuContext:
    """The GPU state of ``comm``, created on first use."""
    if comm._gpu is None:
        comm._gpu = GpuContext(comm)
    return comm._gpu
