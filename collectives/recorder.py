"""The flight recorder: the last operations of this rank, readable from outside the process.

When the rank runs under dtrun (``$DTRUN_JOB_DIR`` set by the launcher), the first
``Comm`` over ``MPI.COMM_WORLD`` maps a small file ``$DTRUN_JOB_DIR/rank.N.rec`` and
writes, for every collective it starts (a non-blocking one under the blocking one's
name), one entry into a ring of ``RING`` slots:
sequence number, operation, dtype, element count and root. dtrun's stack agent reads the
file while the rank is blocked (no cooperation from the rank, no signal), so a hang report
can say "rank 2 is in broadcast #17, the others in allreduce #17".

The file format (header, ring slots, the ``desc`` word) is ``dtrun/recorderfile.py``'s,
which dtrun's agent reads with the standard library: one definition for both sides. The
writer stores ``desc`` before ``seq``. Header word ``INSIDE_WORD`` is 1 while the rank is
inside a blocking collective, 0 otherwise: dtrun's agent on the rank's host reads it a few
hundred times a second for the share of time the rank waits for its peers
(launcher/remote/waitsampler.py), so no clock is read in the collective and none is compared
across hosts. The agent reads the file with pread, and only a regular file of exactly the
format's size (launcher/remote/rankstate.py, ``open_recorder``): a program that replaces or
truncates it gets "flight recorder not read" for its rank, and the rest of the host is reported.

Cost: two stores into the mapped memory per collective, two more for the flag (see
benchmarks/bench_hang.py and benchmarks/bench_straggler.py).
``DTRUN_RECORDER=0`` turns it off.
"""

from __future__ import annotations

import mmap
import os
import stat

from dtrun import recorderfile as _format

# The format's names as this package (and its tests) know them.
MAGIC, VERSION, INSIDE_WORD = _format.MAGIC, _format.VERSION, _format.INSIDE_WORD
RING, HEADER_WORDS, COUNT_BITS = _format.RING, _format.HEADER_WORDS, _format.COUNT_BITS
OPS, DTYPES = _format.OPS, _format.DTYPES
MASK = RING - 1

OP_BITS = {name: i << _format.OP_SHIFT for i, name in enumerate(OPS) if name}
_DTYPE_CODES = {name: i for i, name in enumerate(DTYPES) if name}


def dtype_bits(dtype) -> int:
    """The dtype's field of ``desc`` (0 for a dtype the format does not name)."""
    return _DTYPE_CODES.get(str(dtype), 0) << _format.DTYPE_SHIFT


def root_bits(root: int) -> int:
    if root is None or root < 0:
        return 0
    return (min(int(root), 0xFFFE) + 1) << _format.ROOT_SHIFT


def path_for(job_dir: str, rank) -> str:
    return os.path.join(job_dir, _format.file_name(rank))


def open_ring(rank: int, environ=os.environ):
    """Map this rank's recorder file; returns (mmap, ring view) or None when not under dtrun."""
    job_dir = environ.get("DTRUN_JOB_DIR")
    if not job_dir or environ.get("DTRUN_RECORDER", "1").strip() == "0":
        return None
    nbytes = _format.NBYTES
    try:
        # Never through a link (O_TRUNC would empty the file it names), and only a regular file
        # is made the ring (a FIFO or device put there is left alone: no recorder then).
        fd = os.open(path_for(job_dir, rank), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     0o600)
    except OSError:
        return None  # no job directory on this host: run without a recorder
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        os.ftruncate(fd, 0)  # a new ring: nothing of an earlier file is taken for an entry
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


class Recorder:
    """This rank's mapped recorder file: the ring, its header, and the Python store.

    ``store`` is the writer without the compiled engine (the engine has its own,
    ``Engine.note``, over the same memory)."""

    __slots__ = ("map", "ring", "header", "seq")

    def __init__(self, mm, ring: memoryview) -> None:
        self.map, self.ring, self.header, self.seq = mm, ring, header(mm), 0

    def restart(self, engine=None) -> None:
        """Forget every entry (the ring as a new file has it): the next collective is #1
        again. ``engine``: the compiled engine when it writes this ring too."""
        for i in range(len(self.ring)):
            self.ring[i] = 0
        self.seq = 0
        if engine is not None:
            engine.seq = 0

    def store(self, desc: int) -> None:
        """Record one entry: ``desc``, then its sequence number (a reader trusts a slot
        once its seq is the newest)."""
        s = self.seq = self.seq + 1
        i = (s & MASK) << 1
        self.ring[i + 1] = desc
        self.ring[i] = s


class Owner:
    """Which recorder writer this process has: the first ``Comm`` over
    ``MPI.COMM_WORLD`` to ``claim`` one gets it; later ones (and a second world
    communicator) record nothing, so one file has one writer."""

    __slots__ = ("taken",)

    def __init__(self) -> None:
        self.taken = False

    def claim(self, rank: int, environ=os.environ) -> Recorder | None:
        """The process's recorder on the first call that can open one; None after."""
        if self.taken:
            return None
        opened = open_ring(rank, environ)
        if opened is None:
            return None
        self.taken = True
        return Recorder(*opened)


# This process's owner (tests replace it with a fresh ``Owner()`` to claim again).
OWNER = Owner()


def header(mm) -> memoryview:
    """The header words of a mapped recorder (``open_ring``'s mmap), writable."""
    return memoryview(mm).cast("q")[:HEADER_WORDS]


def decode(buf: bytes) -> dict | None:
    """The recorder's header and entries, oldest first (None if ``buf`` is not one)."""
    if len(buf) % 8:
        return None
    return _format.decode(memoryview(bytes(buf)).cast("q"))
