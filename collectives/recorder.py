"""The flight recorder: the last operations of this rank, readable from outside the process.

When the rank runs under dtrun (``$DTRUN_JOB_DIR`` set by the launcher), the first
``Comm`` over ``MPI.COMM_WORLD`` maps a small file ``$DTRUN_JOB_DIR/rank.N.rec`` and
writes, for every collective it starts (a non-blocking one under the blocking one's
name), one entry into a ring of ``RING`` slots:
sequence number, operation, dtype, element count and root. dtrun's stack agent reads the
file while the rank is blocked (no cooperation from the rank, no signal), so a hang report
can say "rank 2 is in broadcast #17, the others in allreduce #17".

Layout (native int64 words): ``[MAGIC, VERSION, pid, rank, RING, INSIDE, 0, 0]`` then ``RING``
pairs ``(seq, desc)``; entry ``seq`` lives in slot ``seq % RING``; the newest entry is the
largest seq. ``desc`` packs the count (bits 0-35), root + 1 (bits 36-51, 0 = no root),
the dtype (bits 52-57) and the operation (bits 58-62). The writer stores ``desc`` before
``seq``. ``INSIDE`` (word 5, from VERSION 2) is 1 while the rank is inside a blocking
collective, 0 otherwise: dtrun's agent on the rank's host reads it a few hundred times a
second for the share of time the rank waits for its peers (launcher/waitsampler.py), so
no clock is read in the collective and none is compared across hosts.
``launcher/stackagent.py`` decodes the same layout with the standard library (it cannot
import this package); a test keeps the two in step.

Cost: two stores into the mapped memory per collective, two more for the flag (see
benchmarks/bench_hang.py and benchmarks/bench_straggler.py).
``DTRUN_RECORDER=0`` turns it off.
"""

from __future__ import annotations

import mmap
import os

MAGIC = 0x647472756E726563  # "dtrunrec"
VERSION = 2
INSIDE_WORD = 5  # header word: 1 while the rank is inside a blocking collective
RING = 128
MASK = RING - 1
HEADER_WORDS = 8

# Order is the file format: append only.
OPS = ("", "allreduce", "reduce", "broadcast", "scatter", "gather", "allgather", "gatherv",
       "allgatherv", "reduce_scatter", "alltoall", "barrier", "grouped_allreduce")
DTYPES = ("", "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "bfloat16", "complex64", "complex128")

COUNT_BITS = 36
ROOT_SHIFT = 36
DTYPE_SHIFT = 52
OP_SHIFT = 58

OP_BITS = {name: i << OP_SHIFT for i, name in enumerate(OPS) if name}
_DTYPE_CODES = {name: i for i, name in enumerate(DTYPES) if name}


def dtype_bits(dtype) -> int:
    """The dtype's field of ``desc`` (0 for a dtype the format does not name)."""
    return _DTYPE_CODES.get(str(dtype), 0) << DTYPE_SHIFT


def root_bits(root: int) -> int:
    return (min(int(root), 0xFFFE) + 1) << ROOT_SHIFT if root is not None and root >= 0 else 0


def path_for(job_dir: str, rank) -> str:
    return os.path.join(job_dir, f"rank.{rank}.rec")


def open_ring(rank: int, environ=os.environ):
    """Map this rank's recorder file; returns (mmap, ring view) or None when not under dtrun."""
    job_dir = environ.get("DTRUN_JOB_DIR")
    if not job_dir or environ.get("DTRUN_RECORDER", "1").strip() == "0":
        return None
    nbytes = (HEADER_WORDS + 2 * RING) * 8
    try:
        fd = os.open(path_for(job_dir, rank), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return None  # no job directory on this host: run without a recorder
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    except OSError:
        return None
    finally:
        os.close(fd)
    words = memoryview(mm).cast("q")
    for i, v in enumerate((MAGIC, VERSION, os.getpid(), int(rank), RING)):
        words[i] = v
    return mm, words[HEADER_WORDS:]


def header(mm) -> memoryview:
    """The header words of a mapped recorder (``open_ring``'s mmap), writable."""
    return memoryview(mm).cast("q")[:HEADER_WORDS]


def decode(buf: bytes) -> dict | None:
    """The recorder's header and entries, oldest first (None if ``buf`` is not one)."""
    words = memoryview(bytes(buf)).cast("q") if len(buf) % 8 == 0 else None
    if words is None or len(words) < HEADER_WORDS or words[0] != MAGIC:
        return None
    ring = words[4]
    entries = []
    for i in range(ring):
        seq, desc = words[HEADER_WORDS + 2 * i], words[HEADER_WORDS + 2 * i + 1]
        if seq <= 0:
            continue
        op = (desc >> OP_SHIFT) & 0x1F
        dt = (desc >> DTYPE_SHIFT) & 0x3F
        root = ((desc >> ROOT_SHIFT) & 0xFFFF) - 1
        entries.append({"seq": seq, "op": OPS[op] if op < len(OPS) else str(op),
                        "dtype": DTYPES[dt] if dt < len(DTYPES) else str(dt),
                        "count": desc & ((1 << COUNT_BITS) - 1), "root": root if root >= 0 else None})
    entries.sort(key=lambda e: e["seq"])
    return {"pid": words[2], "rank": words[3], "entries": entries}
