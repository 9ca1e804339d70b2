"""Horovod's reduction ops, and the collectives on NumPy arrays that every framework's
module runs (``collectives.horovod._core`` re-exports all of it).

Standard library and NumPy only at import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CollectiveError

# Horovod's reduction ops, as collectives.Comm spells them.
Average, Sum, Min, Max, Product = "avg", "sum", "min", "max", "prod"
OPS = (Average, Sum, Min, Max, Product)
OP_NAMES = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max", Product: "Product"}


def neutral(dtype: np.dtype, op: str):
    """The value that leaves a reduction unchanged (what a joined rank contributes)."""
    if op in (Sum, Average):
        return 0
    if op == Product:
        return 1
    if dtype.kind == "f":
        return np.inf if op == Min else -np.inf
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.max if op == Min else info.min
    return 0


def split_rows(n: int, size: int) -> list[int]:
    """Horovod's split of ``n`` rows over ``size`` ranks: the first n % size get one more."""
    return [n // size + (1 if r < n % size else 0) for r in range(size)]


def np_allreduce(comm: Any, x: np.ndarray, op: str, prescale: float = 1.0,
                 postscale: float = 1.0, inplace: bool = False) -> np.ndarray:
    """Horovod's allreduce on a NumPy array: prescale, reduce, postscale. An integer
    average is a sum divided by the size, truncated (Horovod's integer scaling)."""
    if _is_bf16(x):
        # Reduced in float32 and rounded once: the runtime cannot hand ml_dtypes'
        # bfloat16 arrays to MPI (mpi4py refuses their buffer format).
        from ..dtypes import from_float64, to_float64  # lazy: initialises MPI; hvd.init() does, not the import
        y = np_allreduce(comm, to_float64(x).astype(np.float32), op, prescale, postscale,
                         inplace=True)
        y = from_float64(y.astype(np.float64), x.dtype)
        if inplace:
            x[...] = y
            return x
        return y
    y = x if inplace else x.copy()
    if prescale != 1.0:
        _scale(y, prescale)
    if op == Average and y.dtype.kind in "iub":
        comm.allreduce(y, op=Sum, inplace=True)
        _scale(y, 1.0 / comm.size)
    else:
        comm.allreduce(y, op=op, inplace=True)
    if postscale != 1.0:
        _scale(y, postscale)
    return y


def _is_bf16(x: np.ndarray) -> bool:
    from ..dtypes import BFLOAT16  # lazy: initialises MPI; hvd.init() does, not the import
    return x.dtype == BFLOAT16


def bits(x: np.ndarray) -> np.ndarray:
    """``x`` as plain 16-bit integers when it is bfloat16 (for the collectives that move
    data without arithmetic), else ``x``."""
    return x.view(np.int16) if _is_bf16(x) else x


def _scale(y: np.ndarray, factor: float) -> None:
    """``y *= factor`` as Horovod scales: float16 in float32, rounded once; integers
    truncated."""
    if y.dtype == np.float16:
        y[...] = (y.astype(np.float32) * np.float32(factor)).astype(np.float16)
    elif y.dtype.kind in "fc":
        np.multiply(y, y.dtype.type(factor), out=y)
    else:
        y[...] = np.trunc(y * factor).astype(y.dtype)


def np_allgather(comm: Any, x: np.ndarray) -> np.ndarray:
    """Concatenation along the first dimension; its length may differ per rank."""
    if x.ndim == 0:
        x = x.reshape(1)
    x = np.ascontiguousarray(x)
    return comm.allgatherv(bits(x)).view(x.dtype)


def np_alltoall(comm: Any, x: np.ndarray, splits: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``splits[j]`` of ``x`` go to rank j; returns (received rows, rows received from
    each rank). Without splits the first dimension is split evenly (it must divide)."""
    size = comm.size
    x = np.ascontiguousarray(x)
    if splits is None:
        if x.shape[0] % size:
            raise CollectiveError("alltoall", comm.rank,
                                  f"first dimension {x.shape[0]} does not split evenly over "
                                  f"{size} ranks; pass splits=")
        splits = np.full(size, x.shape[0] // size, dtype=np.int64)
    splits = np.asarray(splits, dtype=np.int64).reshape(-1)
    if splits.size != size or (splits < 0).any() or splits.sum() != x.shape[0]:
        raise CollectiveError("alltoall", comm.rank,
                              f"splits {splits.tolist()} must be {size} non-negative row counts "
                              f"summing to the first dimension {x.shape[0]}")
    received = comm.alltoall(splits.copy())
    per_row = int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
    out = np.empty((int(received.sum()),) + x.shape[1:], dtype=x.dtype)
    from .. import dtypes as _dt  # lazy: initialises MPI; hvd.init() does, not the import
    t = _dt.mpi_type(x.dtype)
    send_counts = (splits * per_row).tolist()
    recv_counts = (received * per_row).tolist()
    comm.mpi.Alltoallv([bits(x), (send_counts, _displs(send_counts)), t],
                       [bits(out), (recv_counts, _displs(recv_counts)), t])
    return out, received


def _displs(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def np_reducescatter(comm: Any, x: np.ndarray, op: str, prescale: float = 1.0,
                     postscale: float = 1.0) -> np.ndarray:
    """Reduce over ranks, then rank r keeps its rows (Horovod's split: the first
    ``n % size`` ranks get one row more)."""
    if x.ndim == 0:
        raise CollectiveError("reducescatter", comm.rank, "needs at least one dimension")
    rows = split_rows(x.shape[0], comm.size)
    start = sum(rows[:comm.rank])
    if x.shape[0] % comm.size == 0 and prescale == 1.0 and postscale == 1.0 \
            and not (op == Average and x.dtype.kind in "iub") and not _is_bf16(x):
        return comm.reduce_scatter(np.ascontiguousarray(x), op=op)
    full = np_allreduce(comm, np.ascontiguousarray(x), op, prescale, postscale)
    return full[start:start + rows[comm.rank]].copy()
