"""The flight recorder's file format: written by each rank (collectives/recorder.py), read by
the host agent (launcher/remote/). Standard library only.

The file ``rank.N.rec`` in the job directory holds native int64 words: a header
``[MAGIC, VERSION, pid, rank, ring, INSIDE, 0, 0]``, then ``ring`` pairs ``(seq, desc)``;
``desc`` packs the count (bits 0-35), root + 1 (bits 36-51, 0 = no root), the dtype
(bits 52-57) and the operation (bits 58-62).

It lives at the top of the ``dtrun`` package, beside neither side, because both import it:
the runtime must not import the launcher, and the agent runs as a script with no
site-packages (launcher/remote/__init__.py makes this module importable there).
"""
MAGIC = 0x647472756E726563  # "dtrunrec"
VERSION = 2
INSIDE_SINCE = 2  # the first version with the INSIDE word
INSIDE_WORD = 5  # header word: 1 while the rank is inside a blocking collective
HEADER_WORDS = 8
RING = 128
NBYTES = 8 * (HEADER_WORDS + 2 * RING)  # the file's size: a file of any other size is not a recorder
# Order is the file format: append only.
OPS = ("", "allreduce", "reduce", "broadcast", "scatter", "gather", "allgather", "gatherv",
       "allgatherv", "reduce_scatter", "alltoall", "barrier", "grouped_allreduce")
DTYPES = ("", "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "bfloat16", "complex64", "complex128")
COUNT_BITS = 36
ROOT_SHIFT = 36
DTYPE_SHIFT = 52
OP_SHIFT = 58


def file_name(rank):
    """The recorder file's name in the job directory."""
    return f"rank.{rank}.rec"


def desc(op, dtype, count, root=None):
    """An entry's ``desc`` word for ``op``/``dtype`` names (0 fields for names the format lacks)."""
    op_code = OPS.index(op) if op in OPS else 0
    dt_code = DTYPES.index(dtype) if dtype in DTYPES else 0
    root_field = min(int(root), 0xFFFE) + 1 if root is not None and root >= 0 else 0
    return (op_code << OP_SHIFT) | (dt_code << DTYPE_SHIFT) | (root_field << ROOT_SHIFT) | int(count)


def decode(words):
    """A recorder's header and entries, oldest first, from its int64 ``words`` (None if not one)."""
    if len(words) < HEADER_WORDS or words[0] != MAGIC:
        return None
    entries = []
    for i in range(words[4]):
        j = HEADER_WORDS + 2 * i
        if j + 1 >= len(words):
            break
        seq, word = words[j], words[j + 1]
        if seq <= 0:
            continue
        op, dt = (word >> OP_SHIFT) & 0x1F, (word >> DTYPE_SHIFT) & 0x3F
        root = ((word >> ROOT_SHIFT) & 0xFFFF) - 1
        entries.append({"seq": seq, "op": OPS[op] if op < len(OPS) else str(op),
                        "dtype": DTYPES[dt] if dt < len(DTYPES) else str(dt),
                        "count": word & ((1 << COUNT_BITS) - 1), "root": root if root >= 0 else None})
    entries.sort(key=lambda e: e["seq"])
    return {"pid": words[2], "rank": words[3], "entries": entries}


def newest_seq(words):
    """The newest sequence number in a recorder's ring (0 when it is empty)."""
    return max(words[HEADER_WORDS::2], default=0)
