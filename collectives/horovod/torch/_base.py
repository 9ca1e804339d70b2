"""What every collective of ``horovod.torch`` shares: tensors as NumPy arrays, requests
submitted to a process set's engine, handles, and Horovod's scaling arithmetic.

A collective is a ``_core.Request`` whose ``run()`` the engine executes on its background
thread once every rank of the process set has submitted the same name; ``run`` uses only
the set's communicator. Named collectives are submitted as ``"<kind>.<name>"``, as
Horovod names them (an allreduce and a broadcast may share a name).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np
import torch

from ...array_kinds import numpy_to_torch, torch_to_numpy
from ...dtypes import BFLOAT16, dtype_name, from_float64, to_float64
from .. import _adasum, _core
from .._core import Adasum, Average, Sum

# Scaling as Horovod's CPU kernels do it (``ScaleBuffer``): integers in float64 then
# truncated, float16 and bfloat16 in float32 then rounded once, float32 and float64 in
# their own precision.
_SCALE_IN = {"f2": np.float32, "f4": np.float32, "f8": np.float64}


class NotATensor:
    """Stands in for an argument that is not a tensor: ``submit`` refuses it."""

    shape = ()

    def __init__(self, value: Any):
        self.type = type(value).__name__
        self.dtype = _core.NOT_A_TENSOR + self.type


class Handle:
    """What the ``*_async`` functions return: pass it to ``poll`` or ``synchronize``
    (``inner``: the engine's handle)."""

    __slots__ = ("engine", "inner")

    def __init__(self, engine: Any, inner: Any):
        self.engine, self.inner = engine, inner

    def __repr__(self) -> str:
        return repr(self.inner)


def scope(process_set: Any, where: str) -> Any:
    """The comm and engine of ``process_set`` (ValueError when unknown or not a member)."""
    return _core.scope(process_set, where)


def to_np(t: Any, where: str, sc: Any) -> Any:
    """A CPU NumPy view of ``t`` (bfloat16 as the runtime's bfloat16); GPU and
    non-contiguous tensors copied. What is not a tensor becomes a ``NotATensor``."""
    if not isinstance(t, torch.Tensor):
        return NotATensor(t)
    src = t.detach()
    if src.device.type != "cpu":
        src = src.cpu()
    if not src.is_contiguous():
        src = src.contiguous()
    return torch_to_numpy(src, where, sc.ranks[sc.rank])


def shares_memory(t: torch.Tensor) -> bool:
    """Whether ``to_np(t)`` is a view of ``t`` (results written there land in ``t``)."""
    return t.device.type == "cpu" and t.is_contiguous()


def to_tensor(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    t = numpy_to_torch(np.ascontiguousarray(a))
    return t.to(like.device) if like.device.type != "cpu" else t


def write_back(tensor: torch.Tensor, y: np.ndarray, is_view: bool) -> torch.Tensor:
    """An in-place collective's result ``y`` into ``tensor`` (``is_view``: ``y`` is a view
    of ``tensor``, the result is there already)."""
    if not is_view:
        with torch.no_grad():
            tensor.copy_(to_tensor(y, tensor).view(tensor.shape))
    return tensor


def signature(arrays: list) -> tuple[tuple, tuple]:
    return tuple(tuple(a.shape) for a in arrays), tuple(
        a.dtype if isinstance(a, NotATensor) else dtype_name(a.dtype) for a in arrays)


def op_name(kind: str, name: Any) -> str | None:
    """Horovod's name of a named collective: ``"<kind>.<name>"`` (None: unnamed)."""
    return None if name is None else f"{kind}.{name}"


# Per engine, this rank's named collectives whose handles were not synchronized (nor polled
# done) yet: submitting such a name again is Horovod's duplicate-name error, at once.
# Horovod frees a name when the collective runs, which its negotiation cycle makes later
# than a script's next call; freed at synchronize, the error is certain, never a race.
_TAKEN: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


def submit(sc: Any, kind: str, name: Any, arrays: list, run: Callable[[], Any], op: str = "",
           root: int = -1) -> Handle:
    """Queue ``run`` on ``sc``'s engine as the collective ``kind`` named ``name``."""
    shapes, dtypes = signature(arrays)
    full = sc.engine.name(kind, op_name(kind, name))
    taken = _TAKEN.setdefault(sc.engine, set())
    if name is not None and full in taken:
        raise _core.DuplicateNameError(
            kind, sc.ranks[sc.rank], f"a collective named {full!r} is already pending on this "
            "rank; synchronize it first or use another name")
    req = _core.Request(kind, full, shapes, dtypes, op, root, run)
    bad = [a for a in arrays if isinstance(a, NotATensor)]
    if bad:
        refuse(sc, req, bad[0])
    handle = Handle(sc.engine, sc.engine.submit(req))
    if name is not None:
        taken.add(full)
    return handle


def _collected(handle: Handle) -> None:
    _TAKEN.get(handle.engine, set()).discard(handle.inner.request.name)


def refuse(sc: Any, req: Any, bad: NotATensor) -> None:
    """``req`` has an argument that is not a tensor: submit it all the same, so that the
    other ranks get a HorovodMismatchError naming this rank instead of waiting for it,
    then raise a TypeError here (Horovod fails on this rank, at the call)."""
    req.run = lambda: None  # never runs: the name's comparison fails on every rank
    try:
        sc.engine.synchronize(sc.engine.submit(req))
    except _core.HorovodMismatchError:
        pass
    raise TypeError(f"{req.kind} on rank {sc.ranks[sc.rank]}: expected a torch.Tensor, got "
                    f"{bad.type} (submitted as {req.name!r}: the other ranks get a mismatch "
                    "error)")


def poll(handle: Any) -> bool:
    """Whether ``handle``'s collective has finished (never waits)."""
    if hasattr(handle, "poll") and not isinstance(handle, Handle):
        return handle.poll()  # a sparse allreduce's handle
    done = handle.engine.poll(handle.inner)
    if done:
        _collected(handle)
    return done


def synchronize(handle: Any) -> Any:
    """Wait for ``handle``'s collective; return its output (a sparse allreduce's handle:
    the reduced sparse tensor, as calling it does)."""
    if not isinstance(handle, Handle):
        if callable(handle):
            return handle()
        raise TypeError(f"synchronize: expected a handle from a hvd *_async call, got "
                        f"{type(handle).__name__}")
    try:
        return handle.engine.synchronize(handle.inner)
    finally:
        _collected(handle)


# ----------------------------------------------------------------------------- arithmetic
def scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """``factor * x`` as Horovod's CPU ``ScaleBuffer`` computes it (a new array)."""
    if x.dtype == BFLOAT16:
        y = to_float64(x).astype(np.float32) * np.float32(factor)
        return from_float64(y.astype(np.float64), x.dtype)
    if x.dtype.kind in "iub":
        return np.trunc(x.astype(np.float64) * factor).astype(x.dtype)
    wide = _SCALE_IN.get(x.dtype.str[1:], np.float64)
    return (x.astype(wide) * wide(factor)).astype(x.dtype)


def reduce_np(comm: Any, x: np.ndarray, op: str, pre: float, post: float,
              inplace: bool = False) -> np.ndarray:
    """Horovod's allreduce of ``x`` over ``comm``: prescale, reduce, postscale. An integer
    average is the sum times ``post / size``, truncated once (Horovod's average is a
    postscale)."""
    y = x if inplace else x.copy()
    if pre != 1.0:
        y[...] = scaled(y, pre)
    if op == Adasum:
        y[...] = _adasum.adasum_allreduce(comm, y, check=False)
    elif op == Average and y.dtype.kind in "iub":
        _core.np_allreduce(comm, y, Sum, inplace=True)
        post = post / comm.size
    else:
        _core.np_allreduce(comm, y, op, inplace=True)
    if post != 1.0:
        y[...] = scaled(y, post)
    return y


def reducescatter_np(comm: Any, x: np.ndarray, op: str, pre: float, post: float) -> np.ndarray:
    """Horovod's reducescatter: prescale, sum, keep this rank's rows (the first
    ``n % size`` ranks one more), then postscale (an average: times ``post / size``)."""
    if op == Average:
        op, post = Sum, post / comm.size
    y = scaled(x, pre) if pre != 1.0 else np.ascontiguousarray(x)
    y = _core.np_reducescatter(comm, y, op)
    return scaled(y, post) if post != 1.0 else y


def check_adasum(sc: Any, where: str, on_gpu: bool = False) -> None:
    """Horovod's limits on Adasum, raised at the call on every rank alike."""
    if sc.ranks != list(range(_core.job(where).size)):
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    if sc.size & (sc.size - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported "
                                  f"yet ({where} on {sc.size} ranks).")
