"""Adasum on the CPU, as Horovod's MPI Adasum computes it (``op=hvd.Adasum``).

The Adasum of two vectors ``a`` and ``b`` is
``(1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b``: their sum when they are orthogonal,
their average when they are parallel. A coefficient stays 1 when its vector's squared norm is
below ``sqrt(DBL_MIN)``, so a zero vector adds nothing and divides by nothing. Over ``2^k``
ranks the pairs form a binary tree: ranks (0,1), (2,3), ... first, then the pairs' results,
and so on (the tree of Horovod's ``reference_tree_reduction``).

The reduction runs as Horovod's does (``horovod/common/ops/adasum/adasum.h``): recursive
vector halving, distance doubling. At level ``d`` = 1, 2, 4, ... a rank swaps half of the part
it holds with rank ``rank ^ d`` (the lower rank keeps the first half), so that each rank ends
up holding one ``1/size`` slice of the result; the dot product and norms each pair needs are
sums of the partial ones of the ``2d`` ranks sharing the vectors, added up by recursive
doubling among those ranks. The halves then travel back the way they came. Several arrays
reduce together as one buffer, each with its own dot product and norms (Horovod's fusion).

Numerics as Horovod's: dot products and norms accumulate in float64 for every dtype; float32
and float64 combine in float64; float16 combines in float32 (Horovod's AVX kernel: the
coefficients rounded to float32, ``a * ca`` then a fused multiply-add). Supported: float16,
float32, float64. Horovod's CPU Adasum needs a power-of-two number of ranks; any other size
raises ``AdasumSizeError`` (a ValueError, and a NotImplementedError as Horovod's) on every rank.

Point-to-point messages go through the communicator's ``sendrecv`` with a tag of their own.
"""

from __future__ import annotations

import math
import sys
import zlib
from typing import Any, Sequence

import numpy as np

from ..errors import CollectiveError, MismatchError, UnsupportedDtypeError

OP = "adasum_allreduce"
TAG = 0x4164  # the tag of every Adasum message
DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_SQRT_DBL_MIN = math.sqrt(sys.float_info.min)  # below it a squared norm counts as zero


class AdasumSizeError(CollectiveError, ValueError, NotImplementedError):
    """The number of ranks is not a power of two (Horovod raises NotImplementedError)."""


def check_size(rank: int, size: int) -> None:
    """Raise ``AdasumSizeError`` unless ``size`` ranks can run Adasum (a power of two). Every
    rank raises alike, without talking to the others: callers may check before submitting."""
    if size < 1 or size & (size - 1):
        raise AdasumSizeError(OP, rank, f"Adasum needs a power-of-two number of ranks, as "
                              f"Horovod's; this job has {size}: run with "
                              f"{2 ** int(math.log2(max(size, 1)))} or "
                              f"{2 ** math.ceil(math.log2(max(size, 1)))} ranks, or reduce with "
                              "op=Average")


def adasum_allreduce(comm: Any, x: np.ndarray, check: bool = True) -> np.ndarray:
    """The Adasum of every rank's ``x`` (same shape and dtype on every rank), on every rank,
    as a new array. Collective over ``comm`` (a ``collectives.Comm``).

    ``check``: first compare every rank's dtype and length (one small allgather), so that a
    difference raises ``MismatchError`` on every rank instead of a truncated message on one;
    pass False where the caller has compared them already (the Horovod engine does)."""
    return adasum_allreduce_many(comm, [x], check)[0]


def adasum_allreduce_many(comm: Any, arrays: Sequence[np.ndarray],
                          check: bool = True) -> list[np.ndarray]:
    """Adasum of several arrays of one dtype at once, each with its own dot product and
    norms (what Horovod does for a fused batch); returns new arrays. See ``adasum_allreduce``."""
    size, rank = comm.size, comm.rank
    check_size(rank, size)
    arrays = [np.asarray(a) for a in arrays]
    problem = _local_problem(arrays)
    if check and size > 1:
        _agree(comm, arrays, problem)
    elif problem:
        raise UnsupportedDtypeError(OP, rank, problem)
    counts = [a.size for a in arrays]
    if len(arrays) == 1:
        buf = np.array(arrays[0], dtype=arrays[0].dtype, order="C").reshape(-1)
    else:
        buf = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.empty(0)
    if size > 1 and buf.size:
        _vhdd(comm, buf, np.cumsum([0] + counts))
    out, start = [], 0
    for a, n in zip(arrays, counts):
        out.append(buf[start:start + n].reshape(a.shape))
        start += n
    return out


def _local_problem(arrays: list[np.ndarray]) -> str | None:
    """What this rank's arrays cannot be (None when they are fine)."""
    kinds = {a.dtype for a in arrays}
    bad = [str(d) for d in kinds if d not in DTYPES]
    if bad:
        return (f"Adasum takes float16, float32 or float64 arrays, as Horovod's CPU Adasum "
                f"does, not {', '.join(sorted(bad))}")
    if len(kinds) > 1:
        return (f"the arrays reduced together must share one dtype, not "
                f"{', '.join(sorted(map(str, kinds)))}")
    return None


def _agree(comm: Any, arrays: list[np.ndarray], problem: str | None) -> None:
    """Raise the same error on every rank unless every rank passed arrays Adasum takes, of
    one dtype and the same lengths."""
    if problem:
        code = 0
    else:  # no arrays at all: agree as float16 with no elements
        code = DTYPES.index(arrays[0].dtype) + 1 if arrays else 1
    counts = np.array([a.size for a in arrays], dtype=np.int64)
    mine = np.array([code, len(arrays), int(counts.sum()), zlib.crc32(counts.tobytes())],
                    dtype=np.int64)
    table = comm.allgather(mine).reshape(comm.size, 4)
    bad = [r for r in range(comm.size) if table[r, 0] == 0]
    if bad:
        where = ", ".join(map(str, bad))
        raise UnsupportedDtypeError(OP, comm.rank, problem if comm.rank in bad else
                                    f"rank(s) {where} passed arrays Adasum does not take "
                                    "(float16, float32 or float64, one dtype)")
    for r in range(1, comm.size):
        if (table[r] != table[0]).any():
            raise MismatchError(OP, comm.rank, _mismatch(table, r))


def _mismatch(table: np.ndarray, r: int) -> str:
    def what(row) -> str:
        return (f"{row[1]} {DTYPES[row[0] - 1]} array(s) of {row[2]} elements"
                + (f" (lengths crc {row[3]:#x})" if row[1] > 1 else ""))
    return (f"rank {r} passed {what(table[r])} but rank 0 {what(table[0])}; every rank must "
            "pass the same shapes and dtype")


def _vhdd(comm: Any, buf: np.ndarray, bounds: np.ndarray) -> None:
    """Replace ``buf`` (flat, this rank's data) by the Adasum over ``comm``, in place.
    ``bounds``: where each array starts in ``buf``, and its end."""
    rank, size = comm.rank, comm.size
    recv = np.empty_like(buf)
    lo, count = 0, buf.size     # the part of buf this rank holds: [lo, lo + count)
    held = []                   # (lo, count) before each level, for the way back
    level = 1
    while level < size:
        peer, first = rank ^ level, count >> 1
        right = bool(rank & level)
        mine = (lo + first, count - first) if right else (lo, first)
        theirs = (lo, first) if right else (lo + first, count - first)
        comm.sendrecv(buf[theirs[0]:sum(theirs)], peer, recv[mine[0]:sum(mine)], peer, TAG, TAG)
        held.append((lo, count))
        lo, count = mine
        _combine(comm, buf, recv, lo, count, bounds, level, right)
        level <<= 1
    level = size >> 1
    while level:
        peer, (plo, pcount) = rank ^ level, held.pop()
        if rank & level:        # the peer holds the part before ours
            theirs = (plo, lo - plo)
        else:
            theirs = (lo + count, plo + pcount - lo - count)
        comm.sendrecv(buf[lo:lo + count], peer, buf[theirs[0]:sum(theirs)], peer, TAG, TAG)
        lo, count = plo, pcount
        level >>= 1


def _combine(comm: Any, buf: np.ndarray, recv: np.ndarray, lo: int, count: int,
             bounds: np.ndarray, level: int, right: bool) -> None:
    """One level's pairwise Adasum on this rank's slice ``[lo, lo + count)``: ``buf`` holds
    this rank's side of it, ``recv`` the peer's. Dot products and norms are summed over the
    ``2 * level`` ranks that share the vectors."""
    hi, n = lo + count, len(bounds) - 1
    sums = np.zeros(3 * n)
    parts = []
    for i in range(n):
        s0, s1 = max(int(bounds[i]), lo), min(int(bounds[i + 1]), hi)
        if s1 <= s0:
            continue
        a, b = buf[s0:s1], recv[s0:s1]
        a64, b64 = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
        aa, bb = float(np.dot(a64, a64)), float(np.dot(b64, b64))
        # slot 1: the lower rank side's norm, slot 2: the upper side's (as Horovod orders them)
        sums[3 * i:3 * i + 3] = (float(np.dot(a64, b64)), bb, aa) if right else \
            (float(np.dot(a64, b64)), aa, bb)
        parts.append((i, a, b))
    sums = _group_sum(comm, sums, level)
    for i, a, b in parts:
        dot = sums[3 * i]
        anorm, bnorm = (sums[3 * i + 2], sums[3 * i + 1]) if right else \
            (sums[3 * i + 1], sums[3 * i + 2])
        ca = 1.0 - dot / anorm * 0.5 if anorm >= _SQRT_DBL_MIN else 1.0
        cb = 1.0 - dot / bnorm * 0.5 if bnorm >= _SQRT_DBL_MIN else 1.0
        a[...] = scaled_add(ca, a, cb, b)


def scaled_add(ca: float, a: np.ndarray, cb: float, b: np.ndarray) -> np.ndarray:
    """``ca * a + cb * b`` in ``a``'s dtype, with Horovod's arithmetic: float64 for float32
    and float64, float32 with one fused multiply-add for float16."""
    if a.dtype == np.float16:
        t = a.astype(np.float32) * np.float32(ca)
        # cb * b is exact in float64 (24 + 11 bits): the sum rounds about as an FMA's does
        fma = np.float64(np.float32(cb)) * b.astype(np.float64) + t
        return fma.astype(np.float32).astype(np.float16)
    return (ca * a.astype(np.float64, copy=False) + cb * b.astype(np.float64, copy=False)
            ).astype(a.dtype, copy=False)


def _group_sum(comm: Any, values: np.ndarray, level: int) -> np.ndarray:
    """The sum of ``values`` over the ``2 * level`` ranks ``rank >> log2(2 * level)`` groups
    together (recursive doubling). Each step adds two equal partial sums in either order,
    which IEEE addition makes bit-identical, so every rank of the group gets the same sum."""
    other = np.empty_like(values)
    d = 1
    while d <= level:
        peer = comm.rank ^ d
        comm.sendrecv(values, peer, other, peer, TAG, TAG)
        values = values + other
        d <<= 1
    return values
