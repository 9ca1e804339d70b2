"""GPU arrays (CuPy, PyTorch CUDA, anything with ``__cuda_array_interface__``).

Nothing here is imported on a CPU-only run: ``collectives.arrays`` calls
``dispatch`` only when an argument lives on a GPU. cupy, torch and NCCL are optional;
each path needs only what it names.

Paths, tried in this order for each call (``Comm.gpu_path(...)`` reports the choice):

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

Function list: ``cuda_aware_mpi``, ``select_device``, ``device_count``, ``dispatch``,
``describe_device``, ``gpu_path``, class ``Nccl`` (ctypes binding), class ``GpuContext``
(per-communicator state: NCCL communicator, pinned buffers).
"""

from __future__ import annotations

import ctypes
import os
import zlib
from typing import Any

import numpy as np
from mpi4py import MPI

from . import dtypes as _dt
from .env import env_local_rank
from .errors import CollectiveError, DeviceError, NotContiguousError, UnsupportedDtypeError
from .handle import Handle

NCCL_OPS = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall",
            "iallreduce", "ibroadcast", "iallgather", "ireduce", "ireduce_scatter", "ialltoall")
_COLLECTIVE_OPS = NCCL_OPS + ("scatter", "gather", "gatherv", "allgatherv",
                              "grouped_allreduce")


# ----------------------------------------------------------------------------- discovery
def _loaded_library(fragment: str) -> str | None:
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
    path = _loaded_library("libmpi.so") or _loaded_library("libmpi_")
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None  # e.g. MPICH: no such extension
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return bool(fn())


def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _cupy():
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:
        return None


def device_count() -> int:
    """CUDA devices visible to this process (0 without torch/cupy or a GPU)."""
    torch = _torch()
    if torch is not None:
        return torch.cuda.device_count()
    cupy = _cupy()
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
    torch = _torch()
    if torch is not None:
        torch.cuda.set_device(dev)
    cupy = _cupy()
    if cupy is not None:
        cupy.cuda.Device(dev).use()
    return dev


def describe_device() -> str:
    """Short name of the current device, e.g. ``cuda:0 NVIDIA H100 80GB HBM3``."""
    torch = _torch()
    if torch is not None:
        d = torch.cuda.current_device()
        return f"cuda:{d} {torch.cuda.get_device_name(d)}"
    cupy = _cupy()
    if cupy is not None:
        d = cupy.cuda.Device().id
        name = cupy.cuda.runtime.getDeviceProperties(d)["name"]
        return f"cuda:{d} {name.decode() if isinstance(name, bytes) else name}"
    return "cpu"


# ----------------------------------------------------------------------------- arrays
class _Dev:
    """What the paths need to know about one device array."""

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


def _is_device(v: Any) -> bool:
    from .arrays import DEVICE, classify
    return classify(v) == DEVICE


def _sync_stream(lib: str) -> None:
    """Wait for queued GPU work before MPI touches device memory (MPI knows no streams)."""
    if lib == "torch":
        import torch
        torch.cuda.current_stream().synchronize()
    else:
        cupy = _cupy()
        if cupy is not None:
            cupy.cuda.get_current_stream().synchronize()


def _stream_ptr(lib: str) -> int:
    if lib == "torch":
        import torch
        return torch.cuda.current_stream().cuda_stream
    import cupy
    return cupy.cuda.get_current_stream().ptr


def _empty_like(d: _Dev, shape: tuple) -> Any:
    """New device array of ``shape`` with the library, dtype and device of ``d``."""
    if d.lib == "torch":
        import torch
        return torch.empty(shape, dtype=d.obj.dtype, device=d.obj.device)
    import cupy
    if d.dtype == _dt.BFLOAT16:
        raise UnsupportedDtypeError("gpu", None, "bfloat16 cupy arrays are not supported")
    with cupy.cuda.Device(d.device if d.device is not None else cupy.cuda.Device().id):
        return cupy.empty(shape, dtype=d.dtype)


# ----------------------------------------------------------------------------- NCCL
class _UniqueId(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array field reads back as bytes cut at the first NUL,
    # which silently corrupts the id (NCCL then dials a garbage address for a minute).
    _fields_ = [("internal", ctypes.c_ubyte * 128)]


_NCCL_DTYPE = {
    np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2,
    np.dtype(np.uint32): 3, np.dtype(np.int64): 4, np.dtype(np.uint64): 5,
    np.dtype(np.float16): 6, np.dtype(np.float32): 7, np.dtype(np.float64): 8,
    _dt.BFLOAT16: 9,
}
_NCCL_OP = {_dt.SUM: 0, _dt.PROD: 1, _dt.MAX: 2, _dt.MIN: 3, _dt.AVG: 4}


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
        loaded = _loaded_library("libnccl.so")  # the copy torch/cupy already use
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


class GpuContext:
    """Per-communicator GPU state, created at the first collective on GPU arrays
    (collective itself: all ranks agree on NCCL there)."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.cuda_aware = bool(cuda_aware_mpi())
        self.cupy = _cupy()
        self.nccl: Nccl | None = None
        self.nccl_comm = None
        self.nccl_error = ""
        self._pinned: dict[tuple[str, int], Any] = {}

    def setup_nccl(self, d: _Dev) -> None:
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


def _pci_id(d: _Dev) -> str:
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
    if comm._gpu is None:
        comm._gpu = GpuContext(comm)
    return comm._gpu


# ----------------------------------------------------------------------------- dispatch
def gpu_path(comm, name: str, x: Any, op: str | None = None) -> str:
    """Which path (nccl, cuda-aware, staging) ``comm.<name>(x)`` takes (collective the
    first time, when NCCL is set up)."""
    ctx = context(comm)
    d = _Dev(x, name, comm.rank)
    return _choose(comm, ctx, name, d, op)


def _choose(comm, ctx: GpuContext, name: str, d: _Dev, op: str | None) -> str:
    if name in NCCL_OPS:
        if ctx.nccl is None and not ctx.nccl_error:
            ctx.setup_nccl(d)
        canon = _dt.OP_ALIASES.get(str(op).lower(), op) if op else None
        if (ctx.nccl is not None and d.dtype in _NCCL_DTYPE
                and (canon is None or (canon in _NCCL_OP and (canon != _dt.AVG
                                                              or ctx.nccl.version >= 21000)))):
            return "nccl"
    if ctx.cuda_aware and ctx.cupy is not None and d.dtype != _dt.BFLOAT16:
        return "cuda-aware"
    return "staging"


def dispatch(comm, name: str, args: tuple, kwargs: dict) -> Any:
    """Run ``comm.<name>`` with GPU arrays among ``args``/``kwargs``."""
    ctx = context(comm)
    first = next((v for v in list(args) + list(kwargs.values()) if _is_device(v)), None)
    if first is None and name == "grouped_allreduce":
        first = next(v for v in args[0] if _is_device(v))
    d = _Dev(first, name, comm.rank)
    if name == "grouped_allreduce":
        path = _choose(comm, ctx, "allreduce", d, kwargs.get("op", "sum"))
        if path == "nccl":
            return _nccl_grouped(comm, ctx, args[0], kwargs.get("op", "sum"))
        return _staged(comm, ctx, name, args, kwargs) if path == "staging" else \
            _cuda_aware(comm, ctx, name, args, kwargs)
    if name in _COLLECTIVE_OPS:
        path = _choose(comm, ctx, name, d, kwargs.get("op"))
    else:  # point to point: never NCCL (its setup is collective)
        path = "cuda-aware" if (ctx.cuda_aware and ctx.cupy is not None
                                and d.dtype != _dt.BFLOAT16) else "staging"
    if path == "nccl":
        return _nccl_call(comm, ctx, name, args, kwargs)
    if path == "cuda-aware":
        return _cuda_aware(comm, ctx, name, args, kwargs)
    return _staged(comm, ctx, name, args, kwargs)


# --- path 3: staging through pinned host memory
def _staged(comm, ctx: GpuContext, name: str, args: tuple, kwargs: dict) -> Any:
    slots = iter(range(1 << 30))
    fresh = name.startswith("i")  # in flight after we return: must not share the pool
    staged: list[tuple[_Dev, np.ndarray, Any]] = []  # (device array, host view, torch view)

    def to_host(v):
        if not _is_device(v):
            return v
        d = _Dev(v, name, comm.rank)
        buf = ctx.pinned(next(slots), d.nbytes, d.lib, fresh)
        if d.lib == "torch":
            import torch
            tv = buf[:d.nbytes].view(v.dtype).view(d.shape) if d.nbytes else \
                torch.empty(d.shape, dtype=v.dtype, pin_memory=True)
            tv.copy_(v)  # ordered after queued work on the current stream; blocking
            from .arrays import torch_to_numpy
            host = torch_to_numpy(tv, name, comm.rank)
        else:
            host = np.asarray(buf[:d.nbytes]).view(d.dtype).reshape(d.shape)
            v.get(out=host) if hasattr(v, "get") else _cai_copy(host, v)
        staged.append((d, host, None))
        return host

    new_args = tuple([to_host(a) for a in v] if isinstance(v, list) else to_host(v)
                     for v in args)
    new_kwargs = {k: to_host(v) for k, v in kwargs.items()}
    if name == "grouped_allreduce":
        new_kwargs["_cache"] = False  # host views are new objects every call
    result = getattr(comm, name)(*new_args, **new_kwargs)
    template = staged[0][0]

    def back(r):
        if isinstance(r, list):
            return [back(v) for v in r]
        if not isinstance(r, np.ndarray):
            return r
        for d, host, _ in staged:  # results that are (views of) a staged input: copy back
            base = host.ctypes.data
            if host.nbytes and base <= r.ctypes.data < base + host.nbytes or r is host:
                _to_device(d, host)
                off = (r.ctypes.data - base) // d.dtype.itemsize
                return _view(d, off, r.size, r.shape)
        dev = _empty_like(template, r.shape)
        _to_device(_Dev(dev, name, comm.rank), r)
        return dev

    return _finish(result, back, (new_args, new_kwargs))


def _finish(result: Any, back, keep) -> Any:
    """Map a result back to the caller's array type, now or, for a Handle, when it completes."""
    if isinstance(result, Handle):
        inner = result
        return Handle(inner, None, post=lambda _: back(inner.wait()), keep=keep, op=inner.op)
    return back(result)


def _cai_copy(host: np.ndarray, v: Any) -> None:
    import cupy
    cupy.asarray(v).get(out=host)


def _to_device(d: _Dev, host: np.ndarray) -> None:
    """Copy ``host`` (same size) into the device array of ``d``."""
    if d.nbytes == 0:
        return
    if d.lib == "torch":
        from .arrays import numpy_to_torch
        d.obj.copy_(numpy_to_torch(host).reshape(d.shape))
    else:
        import cupy
        cupy.asarray(d.obj).set(np.ascontiguousarray(host).reshape(d.shape))


def _view(d: _Dev, offset: int, count: int, shape: tuple) -> Any:
    """View of ``count`` elements of ``d`` from element ``offset``, reshaped."""
    if offset == 0 and count == d.size and tuple(shape) == d.shape:
        return d.obj
    return d.obj.reshape(-1)[offset:offset + count].reshape(shape)


# --- path 2: CUDA-aware MPI on cupy views
def _cuda_aware(comm, ctx: GpuContext, name: str, args: tuple, kwargs: dict) -> Any:
    if name not in _CORE_SIGNATURES and name not in _P2P and name != "grouped_allreduce":
        return _staged(comm, ctx, name, args, kwargs)  # e.g. ibroadcast: no device core
    cupy = ctx.cupy
    originals: dict[int, Any] = {}
    libs = set()

    def conv(v):
        if not _is_device(v):
            return v
        d = _Dev(v, name, comm.rank)
        libs.add(d.lib)
        c = v if d.lib == "cupy" else cupy.asarray(v)  # zero-copy via the CAI
        originals[id(c)] = v
        return c

    new_args = tuple([conv(a) for a in v] if isinstance(v, list) else conv(v) for v in args)
    new_kwargs = {k: conv(v) for k, v in kwargs.items()}
    for lib in libs:
        _sync_stream(lib)
    if name in ("send", "recv", "isend", "irecv", "sendrecv"):
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

    return _finish(result, back, (new_args, new_kwargs))


_CORE_SIGNATURES = {
    "allreduce": ("x", "op", "out", "inplace"),
    "iallreduce": ("x", "op", "out", "inplace"),
    "reduce": ("x", "op", "root", "out", "inplace"),
    "broadcast": ("x", "root", "out", "inplace"),
    "scatter": ("x", "root", "out", "inplace"),
    "gather": ("x", "root", "out", "inplace"),
    "allgather": ("x", "out", "inplace"),
    "allgatherv": ("x", "out"),
    "gatherv": ("x", "root", "out"),
    "reduce_scatter": ("x", "op", "out", "inplace"),
    "alltoall": ("x", "out", "inplace"),
}
_DEFAULTS = {"op": "sum", "root": 0, "out": None, "inplace": False}
_P2P = ("send", "recv", "isend", "irecv", "sendrecv")


def _call_core(comm, name, impl, args, kwargs, xp):
    params = _CORE_SIGNATURES[name]
    values = dict(_DEFAULTS)
    values.update(zip(params, args))
    values.update(kwargs)
    return impl(*[values[p] for p in params], xp)


def _p2p_device(comm, name, args, kwargs):
    from .dtypes import mpi_type
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


# --- path 1: NCCL
class _EventRequest:
    """Completion of stream-ordered NCCL work, with MPI.Request's Wait/Test."""

    def __init__(self, lib: str) -> None:
        if lib == "torch":
            import torch
            self.event = torch.cuda.Event()
            self.event.record()
            self._query = self.event.query
        else:
            import cupy
            self.event = cupy.cuda.Event()
            self.event.record()
            self._query = lambda: self.event.done
        self._sync = self.event.synchronize

    def Wait(self) -> None:  # noqa: N802
        self._sync()

    def Test(self) -> bool:  # noqa: N802
        return bool(self._query())


def _nccl_call(comm, ctx: GpuContext, name: str, args: tuple, kwargs: dict) -> Any:
    blocking = not name.startswith("i")
    base = name if blocking else name[1:]
    params = _CORE_SIGNATURES.get(base, ("x", "op", "out", "inplace"))
    values = dict(_DEFAULTS)
    values.update(zip(params, args))
    values.update(kwargs)
    x = _Dev(values["x"], name, comm.rank)
    out_obj, inplace = values.get("out"), values.get("inplace", False)
    lib, nc, stream = ctx.nccl.lib, ctx.nccl_comm, _stream_ptr(x.lib)
    dt = _NCCL_DTYPE[x.dtype]
    size, rank = comm.size, comm.rank
    op_name = _dt.OP_ALIASES.get(str(values.get("op", "sum")).lower(), "sum")
    nop = _NCCL_OP[op_name]
    if op_name == _dt.AVG and x.dtype.kind not in "f" and x.dtype != _dt.BFLOAT16:
        raise UnsupportedDtypeError(name, rank, _dt.reduce_problem(x.dtype, _dt.AVG))
    check = ctx.nccl.check

    def rows() -> int:
        n = x.shape[0] if x.shape else 1
        if n % size:
            raise CollectiveError(base, rank, f"axis 0 has length {n}, which {size} ranks "
                                  "cannot split evenly")
        return n // size

    def out_for(shape):
        if inplace or out_obj is values["x"]:
            return x
        if out_obj is None:
            return _Dev(_empty_like(x, shape), name, rank)
        o = _Dev(out_obj, name, rank)
        if o.shape != tuple(shape) or o.dtype != x.dtype:
            raise CollectiveError(base, rank, f"out has shape {o.shape} dtype {o.dtype}, "
                                  f"expected {tuple(shape)} {x.dtype}")
        return o

    result: Any
    if base == "allreduce":
        o = out_for(x.shape)
        check(lib.ncclAllReduce(x.ptr, o.ptr, x.size, dt, nop, nc, stream), "allreduce")
        result = o.obj
    elif base == "reduce":
        root = values["root"]
        o = out_for(x.shape) if rank == root else x
        check(lib.ncclReduce(x.ptr, o.ptr, x.size, dt, nop, root, nc, stream), "reduce")
        result = o.obj if rank == root else None
    elif base == "broadcast":
        root = values["root"]
        o = out_for(x.shape)
        check(lib.ncclBroadcast(x.ptr, o.ptr, x.size, dt, root, nc, stream), "broadcast")
        result = o.obj
    elif base == "allgather":
        if inplace or out_obj is values["x"]:
            r = rows()
            per = x.size // size
            check(lib.ncclAllGather(x.ptr + rank * per * x.dtype.itemsize, x.ptr, per, dt,
                                    nc, stream), "allgather")
            result = x.obj
        else:
            shape = ((x.shape[0] if x.shape else 1) * size,) + x.shape[1:]
            o = out_for(shape)
            check(lib.ncclAllGather(x.ptr, o.ptr, x.size, dt, nc, stream), "allgather")
            result = o.obj
    elif base == "reduce_scatter":
        r = rows()
        shape = (r,) + x.shape[1:]
        per = x.size // size
        if inplace:
            # NCCL's in-place form puts rank i's part at offset i; ours (like MPI's
            # IN_PLACE) at offset 0: reduce into offset i, then move it to the front.
            off = x.ptr + rank * per * x.dtype.itemsize
            check(lib.ncclReduceScatter(x.ptr, off, per, dt, nop, nc, stream),
                  "reduce_scatter")
            flat = x.obj.reshape(-1)
            part = flat[rank * per:(rank + 1) * per].clone() if x.lib == "torch" else \
                flat[rank * per:(rank + 1) * per].copy()
            flat[:per] = part
            result = _view(x, 0, per, shape)
        else:
            o = out_for(shape)
            check(lib.ncclReduceScatter(x.ptr, o.ptr, per, dt, nop, nc, stream),
                  "reduce_scatter")
            result = o.obj
    elif base == "alltoall":
        rows()
        per = x.size // size
        nb = per * x.dtype.itemsize
        tmp = None
        if inplace or out_obj is values["x"]:
            tmp = _Dev(_empty_like(x, x.shape), name, rank)
            o = tmp
        else:
            o = out_for(x.shape)
        check(lib.ncclGroupStart(), "alltoall")
        for peer in range(size):
            check(lib.ncclSend(x.ptr + peer * nb, per, dt, peer, nc, stream), "alltoall")
            check(lib.ncclRecv(o.ptr + peer * nb, per, dt, peer, nc, stream), "alltoall")
        check(lib.ncclGroupEnd(), "alltoall")
        if tmp is not None:
            x.obj.copy_(tmp.obj) if x.lib == "torch" else x.obj.__setitem__(Ellipsis, tmp.obj)
            result = x.obj
        else:
            result = o.obj
    else:
        raise CollectiveError(name, rank, "no NCCL implementation")
    if blocking:
        return result
    return Handle(_EventRequest(x.lib), result, keep=values["x"], op=name)


def _nccl_grouped(comm, ctx: GpuContext, arrays: list, op: str) -> list:
    """Fused allreduce on GPU: NCCL group calls (NCCL fuses them itself)."""
    lib, nc = ctx.nccl.lib, ctx.nccl_comm
    canon = _dt.OP_ALIASES.get(str(op).lower(), "sum")
    devs = [_Dev(a, "grouped_allreduce", comm.rank) for a in arrays]
    stream = _stream_ptr(devs[0].lib)
    ctx.nccl.check(lib.ncclGroupStart(), "grouped_allreduce")
    for d in devs:
        ctx.nccl.check(lib.ncclAllReduce(d.ptr, d.ptr, d.size, _NCCL_DTYPE[d.dtype],
                                         _NCCL_OP[canon], nc, stream), "grouped_allreduce")
    ctx.nccl.check(lib.ncclGroupEnd(), "grouped_allreduce")
    return list(arrays)
