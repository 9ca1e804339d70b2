"""A collective's signature: what a rank is about to call, in three int64 words.

Ranks compare it before they exchange any data, so that ranks that called different
things (another operation, dtype, element count, reduction op, root, allreduce path, or
list of arrays) all raise ``MismatchError`` naming each side, instead of reducing
garbage or waiting forever. Where it travels (sigcheck.py, ``_fastshm.c``): beside the
counter of the compiled engine's first synchronisation (one host), or in a 48-byte MPI
allreduce (MAX of the words and of their negations: equal on all ranks iff max == -max).

Words:

* ``w0``: ``PRESENT`` | operation | dtype | reduction op | path | root + 1 (zero: no
  signature, never compared);
* ``w1``: the element count (grouped_allreduce: all arrays together);
* ``w2``: grouped_allreduce: the number of arrays (bits 40-62) and a 40-bit
  fingerprint of each array's dtype and element count, the op and the fusion threshold
  (the count and number of arrays are compared exactly, so the fingerprint only has to
  tell lists of the same length and total apart); 0 otherwise.

Standard library and NumPy only; the engine is told the shifts (``Comm`` passes them).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

from . import recorder as _rec

PRESENT = 1 << 62
KIND_SHIFT, KIND_BITS = 0, 5
DTYPE_SHIFT, DTYPE_BITS = 5, 6
REDOP_SHIFT, REDOP_BITS = 11, 3
PATH_SHIFT, PATH_BITS = 14, 4
ROOT_SHIFT, ROOT_BITS = 18, 40
GROUP_SHIFT = 40

# Order is the wire format: append only. Non-blocking forms share the blocking code.
KINDS = ("", "allreduce", "reduce", "broadcast", "scatter", "gather", "allgather", "gatherv",
         "allgatherv", "reduce_scatter", "alltoall", "barrier", "grouped_allreduce")
REDOPS = ("", "sum", "prod", "min", "max", "avg")
# Allreduce paths (tuning.PATHS order); 0: a collective with no path choice.
PATHS = ("", "mpi", "shm1", "shm2", "shm", "shm+hierarchical", "shm+ring", "ring", "stream")

_KIND = {k: i for i, k in enumerate(KINDS) if k}
_REDOP = {k: i for i, k in enumerate(REDOPS) if k}
_PATH = {k: i for i, k in enumerate(PATHS) if k}
_DTYPES = _rec.DTYPES  # the recorder's dtype codes (0: none)
_DTYPE = {k: i for i, k in enumerate(_DTYPES) if k}


def _field(w: int, shift: int, bits: int) -> int:
    return (w >> shift) & ((1 << bits) - 1)


def meta(kind: str, dtype: str | None = None, redop: str | None = None,
         path: str | None = None, root: int = -1) -> int:
    """``w0`` for operation ``kind`` on ``dtype`` (a name: dtypes.dtype_name)."""
    w = PRESENT | _KIND[kind] << KIND_SHIFT
    if dtype:
        w |= _DTYPE.get(dtype, 0) << DTYPE_SHIFT
    if redop:
        w |= _REDOP[redop] << REDOP_SHIFT
    if path:
        w |= _PATH[path] << PATH_SHIFT
    if root >= 0:
        w |= ((root + 1) & ((1 << ROOT_BITS) - 1)) << ROOT_SHIFT
    return w


def group_words(arrays: Sequence, redop: str, threshold: int) -> tuple[int, int, int]:
    """The signature of ``grouped_allreduce(arrays, op=redop)`` (NumPy arrays)."""
    rows = [(a.dtype.str, a.size) for a in arrays]
    digest = hashlib.blake2b(repr((rows, redop, threshold)).encode(), digest_size=8).digest()
    fp = struct.unpack("<Q", digest)[0] & ((1 << GROUP_SHIFT) - 1)
    return (meta("grouped_allreduce", None, redop), sum(r[1] for r in rows),
            (len(rows) << GROUP_SHIFT) | fp)


def describe(words: Sequence[int]) -> str:
    """What a rank called, from its signature: "allreduce of 10 x float32 (sum, path shm1)"."""
    w0, w1, w2 = (int(v) for v in words)
    if not w0 & PRESENT:
        return "no signature (DTRUN_CHECK=0 on that rank)"
    kind = KINDS[_field(w0, KIND_SHIFT, KIND_BITS)] or "?"
    dtype = _DTYPES[_field(w0, DTYPE_SHIFT, DTYPE_BITS)] if \
        _field(w0, DTYPE_SHIFT, DTYPE_BITS) < len(_DTYPES) else "?"
    redop = REDOPS[_field(w0, REDOP_SHIFT, REDOP_BITS)] if \
        _field(w0, REDOP_SHIFT, REDOP_BITS) < len(REDOPS) else "?"
    path = PATHS[_field(w0, PATH_SHIFT, PATH_BITS)] if \
        _field(w0, PATH_SHIFT, PATH_BITS) < len(PATHS) else "?"
    root = _field(w0, ROOT_SHIFT, ROOT_BITS) - 1
    if kind == "grouped_allreduce":
        what = (f"{kind} of {w2 >> GROUP_SHIFT} arrays, {w1} elements in all "
                f"(list fingerprint {w2 & ((1 << GROUP_SHIFT) - 1):010x})")
    elif kind == "barrier":
        what = kind
    elif kind in ("gatherv", "allgatherv"):
        what = f"{kind} of {dtype}"
    else:
        what = f"{kind} of {w1} x {dtype}" if dtype else f"{kind} of {w1} elements"
    extra = [f"op {redop}"] if redop else []
    if path:
        extra.append(f"path {path}")
    if root >= 0:
        extra.append(f"root {root}")
    return what + (f" ({', '.join(extra)})" if extra else "")


def explain(rows: Sequence[Sequence[int]]) -> str:
    """Every distinct signature with the ranks that passed it (``rows[rank]``)."""
    groups: dict[tuple, list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(tuple(int(v) for v in row), []).append(rank)
    parts = []
    for words, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else \
            f"ranks {', '.join(str(r) for r in ranks)}"
        parts.append(f"{who}: {describe(words)}")
    return "; ".join(parts)
