"""The two formats that cross from a host's processes to dtrun (standard library only).

* The rank wrapper's markers (written by ``rankexec``, read by the launcher): one line each,
  ``dtrun-rank-start: token=T rank=R host=H`` on stderr when the wrapper starts,
  ``dtrun-rank-eof: token=T rank=R`` as its last stdout line, and when the program failed
  ``dtrun-rank-exit: token=T rank=R host=H code=C|signal=S [forwarded=0|1] [t=SECONDS]
  [start-error=WHY; program=NAME]`` on stderr. The token is the job's random one
  (``MARKER_TOKEN_ENV``), so a program that prints a marker's text is never taken for one.
* The flight recorder (written by collectives/recorder.py in each rank, read by the agent):
  native int64 words ``[REC_MAGIC, REC_VERSION, pid, rank, ring, INSIDE, 0, 0]``, then ``ring``
  pairs ``(seq, desc)``; ``desc`` packs the count (bits 0-35), root + 1 (bits 36-51, 0 = no
  root), the dtype (bits 52-57) and the operation (bits 58-62).

Both sides import this module, so the formats are written down once.
"""
import re

# --- rank wrapper markers ---------------------------------------------------------------------
MARKER = "dtrun-rank-exit:"
START_MARKER = "dtrun-rank-start:"
EOF_MARKER = "dtrun-rank-eof:"
MARKER_TOKEN_ENV = "DTRUN_MARKER_TOKEN"
_TOKEN_RE = re.compile(r"[0-9A-Za-z]{1,64}")


def marker_head(name, token):
    """A marker's fixed start, with the job's token: ``dtrun-rank-eof: token=T`` (no token: the name)."""
    return f"{name} token={token}" if token else name


def job_token(environ):
    """The job's marker token from dtrun (letters and digits only), or "" outside dtrun."""
    token = environ.get(MARKER_TOKEN_ENV, "")
    return token if _TOKEN_RE.fullmatch(token) else ""


def start_line(token, rank, host):
    return f"{marker_head(START_MARKER, token)} rank={rank} host={host}\n"


def eof_line(token, rank):
    return f"{marker_head(EOF_MARKER, token)} rank={rank}\n"


def exit_line(token, rank, host, t, code=None, signum=None, forwarded=False, start_error=None, program=None):
    """A failed program's marker: ``code`` or ``signum`` (with ``forwarded``: the launcher was
    stopping the rank), ``t`` when it ended; ``start_error``/``program`` when it never ran."""
    how = f"signal={signum} forwarded={int(bool(forwarded))}" if signum is not None else f"code={code}"
    tail = ""
    if start_error is not None:
        why = start_error.replace(";", ",").replace("\n", " ")
        tail = f" start-error={why}; program={(program or '').replace(chr(10), ' ')}"
    return f"{marker_head(MARKER, token)} rank={rank} host={host} {how} t={t:.6f}{tail}\n"


def exit_regex(token):
    """The exit marker's pattern; groups: rank, host, code|signal, value, forwarded, t, start-error, program."""
    return (re.escape(marker_head(MARKER, token)) + r" rank=(\S+) host=(\S+) (code|signal)=(-?\d+)"
            r"(?: forwarded=([01]))?(?: t=(\d+(?:\.\d+)?))?(?: start-error=([^;]*); program=(.*))?")


def start_regex(token):
    """The start marker's pattern; groups: rank, host."""
    return re.escape(marker_head(START_MARKER, token)) + r" rank=(\S+) host=(\S+)"


def eof_head(token):
    """The end-of-output marker up to its rank number."""
    return marker_head(EOF_MARKER, token) + " rank="


# --- flight recorder file ---------------------------------------------------------------------
REC_MAGIC = 0x647472756E726563  # "dtrunrec"
REC_VERSION = 2
REC_INSIDE_SINCE = 2  # the first version with the INSIDE word
REC_INSIDE_WORD = 5  # header word: 1 while the rank is inside a blocking collective
REC_HEADER_WORDS = 8
REC_RING = 128
# Order is the file format: append only.
REC_OPS = ("", "allreduce", "reduce", "broadcast", "scatter", "gather", "allgather", "gatherv",
           "allgatherv", "reduce_scatter", "alltoall", "barrier", "grouped_allreduce")
REC_DTYPES = ("", "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
              "float16", "float32", "float64", "bfloat16", "complex64", "complex128")
REC_COUNT_BITS = 36
REC_ROOT_SHIFT = 36
REC_DTYPE_SHIFT = 52
REC_OP_SHIFT = 58


def rec_file(rank):
    """The recorder file's name in the job directory."""
    return f"rank.{rank}.rec"


def rec_desc(op, dtype, count, root=None):
    """An entry's ``desc`` word for ``op``/``dtype`` names (0 fields for names the format lacks)."""
    op_code = REC_OPS.index(op) if op in REC_OPS else 0
    dt_code = REC_DTYPES.index(dtype) if dtype in REC_DTYPES else 0
    root_field = min(int(root), 0xFFFE) + 1 if root is not None and root >= 0 else 0
    return (op_code << REC_OP_SHIFT) | (dt_code << REC_DTYPE_SHIFT) | (root_field << REC_ROOT_SHIFT) | int(count)


def rec_decode(words):
    """A recorder's header and entries, oldest first, from its int64 ``words`` (None if not one)."""
    if len(words) < REC_HEADER_WORDS or words[0] != REC_MAGIC:
        return None
    entries = []
    for i in range(words[4]):
        j = REC_HEADER_WORDS + 2 * i
        if j + 1 >= len(words):
            break
        seq, desc = words[j], words[j + 1]
        if seq <= 0:
            continue
        op, dt = (desc >> REC_OP_SHIFT) & 0x1F, (desc >> REC_DTYPE_SHIFT) & 0x3F
        root = ((desc >> REC_ROOT_SHIFT) & 0xFFFF) - 1
        entries.append({"seq": seq, "op": REC_OPS[op] if op < len(REC_OPS) else str(op),
                        "dtype": REC_DTYPES[dt] if dt < len(REC_DTYPES) else str(dt),
                        "count": desc & ((1 << REC_COUNT_BITS) - 1), "root": root if root >= 0 else None})
    entries.sort(key=lambda e: e["seq"])
    return {"pid": words[2], "rank": words[3], "entries": entries}


def rec_newest_seq(words):
    """The newest sequence number in a recorder's ring (0 when it is empty)."""
    return max(words[REC_HEADER_WORDS::2], default=0)
