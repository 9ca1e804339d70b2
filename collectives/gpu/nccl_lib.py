"""Minimal ctypes binding of libnccl and its dtype/op codes."""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .. import dtypes as _dt
from ..errors import CollectiveError
from .discovery import loaded_library


class _UniqueId(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array field reads back as bytes cut at the first NUL,
    # which silently corrupts the id (NCCL then dials a garbage address for a minute).
    _fields_ = [("internal", ctypes.c_ubyte * 128)]


NCCL_DTYPE = {
    np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2,
    np.dtype(np.uint32): 3, np.dtype(np.int64): 4, np.dtype(np.uint64): 5,
    np.dtype(np.float16): 6, np.dtype(np.float32): 7, np.dtype(np.float64): 8,
    _dt.BFLOAT16: 9,
}
NCCL_OP = {_dt.SUM: 0, _dt.PROD: 1, _dt.MAX: 2, _dt.MIN: 3, _dt.AVG: 4}
NCCL_AVG_VERSION = 21000  # ncclAvg arrived in NCCL 2.10


class Nccl:
    """Minimal ctypes binding of libnccl (NCCL >= 2.7 for send/recv, 2.10 for avg)."""

    def __init__(self) -> None:
        path = self._find()
        self.lib = ctypes.CDLL(path)
        self.path = path
        lib = self.lib
        vp, sz, ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for name, args in {
            "ncclGetVersion": [ctypes.POINTER(ci)],
            "ncclGetUniqueId": [ctypes.POINTER(_UniqueId)],
            "ncclCommInitRank": [ctypes.POINTER(vp), ci, _UniqueId, ci],
            "ncclCommDestroy": [vp],
            "ncclAllReduce": [vp, vp, sz, ci, ci, vp, vp],
            "ncclReduce": [vp, vp, sz, ci, ci, ci, vp, vp],
            "ncclBroadcast": [vp, vp, sz, ci, ci, vp, vp],
            "ncclAllGather": [vp, vp, sz, ci, vp, vp],
            "ncclReduceScatter": [vp, vp, sz, ci, ci, vp, vp],
            "ncclSend": [vp, sz, ci, ci, vp, vp],
            "ncclRecv": [vp, sz, ci, ci, vp, vp],
            "ncclGroupStart": [],
            "ncclGroupEnd": [],
        }.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ci
        lib.ncclGetErrorString.argtypes = [ci]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        v = ci()
        self.check(lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        self.version = v.value  # e.g. 22809 for 2.28.9
        self.rank: int | None = None  # set once a communicator exists, for messages

    @staticmethod
    def _find() -> str:
        explicit = os.environ.get("DTRUN_NCCL_LIB")
        if explicit:
            return explicit
        loaded = loaded_library("libnccl.so")  # the copy torch/cupy already use
        if loaded:
            return loaded
        try:  # the nvidia-nccl-cu* wheels
            import nvidia.nccl  # type: ignore
            for base in list(getattr(nvidia.nccl, "__path__", [])):
                cand = os.path.join(base, "lib", "libnccl.so.2")
                if os.path.exists(cand):
                    return cand
        except ImportError:
            pass
        return "libnccl.so.2"

    def check(self, status: int, what: str) -> None:
        if status != 0:
            msg = self.lib.ncclGetErrorString(status).decode(errors="replace")
            raise CollectiveError(what, self.rank, f"NCCL error {status}: {msg}")

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), 128)

    def init_rank(self, nranks: int, uid: bytes, rank: int) -> ctypes.c_void_p:
        comm = ctypes.c_void_p()
        u = _UniqueId()
        ctypes.memmove(ctypes.byref(u), uid, 128)
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), nranks, u, rank),
                   "ncclCommInitRank")
        return comm
