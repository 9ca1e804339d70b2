"""The compiled shared-memory paths ("shm1", "shm2") and the flight recorder's compiled store.

``_fastshm.c`` holds the C side; this module sets it up. Why a compiled path: below
about 16 KiB an allreduce costs 1-5 us, the Python shared-memory path (shm.py) spends
that on NumPy calls alone, and MPI's own shared-memory allreduce takes about 1 us. The
compiled one copies the input into this rank's slot, posts a counter, waits for the
other ranks' counters (spin, then sched_yield, then a futex: as waits.py) and reduces
every slot in local-rank order: one synchronisation per step of up to ``cap`` bytes, and
every rank gets the same bits.

It is optional: the package builds it when a C compiler and Python's headers are there
(setup.py) and works without it. ``DTRUN_COMPILED=0`` turns it off (the pure-Python
paths and recorder, as without the build).
"""

from __future__ import annotations

import os

import numpy as np

from ._mpi import MPI
from . import waits

try:
    from . import _fastshm
except ImportError:  # not built: no compiler or headers at install time
    _fastshm = None

# The engine's type codes, in _fastshm.c's order.
TYPE_NAMES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
              "float32", "float64")


# same_items(a, b): whether sequences a and b hold the very same objects, in order
# (compiled; None when the engine is not built). Bound directly: no Python frame per call.
same_items = _fastshm.same_items if _fastshm is not None else None


def available() -> bool:
    """Whether the compiled engine is built and not turned off (``DTRUN_COMPILED=0``)."""
    if _fastshm is None:
        return False
    raw = os.environ.get("DTRUN_COMPILED", "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"DTRUN_COMPILED={raw!r}: use 1 (the compiled path where built) or 0")
    return raw == "1"


def why_not() -> str:
    """Why ``available()`` is false, for messages."""
    if _fastshm is None:
        return "dtrun.collectives._fastshm is not built (no C compiler or Python headers at install)"
    return "DTRUN_COMPILED=0"


def stream_mode() -> int:
    """``DTRUN_SHM_NT``: how the compiled paths write a slot in a call of 256 KiB or more:
    ``auto`` (the default: streaming stores where the ranks' cores are in different cache
    domains, timed at every such call; see _fastshm.c), ``1`` always streaming, ``0``
    never. Returns the engine's code: -1, 1 or 0.

    Raises:
        ValueError: another value (the message names it).
    """
    raw = os.environ.get("DTRUN_SHM_NT", "auto").strip().lower() or "auto"
    codes = {"auto": -1, "1": 1, "0": 0}
    if raw not in codes:
        raise ValueError(f"DTRUN_SHM_NT={raw!r}: use auto (chosen per call), 1 (streaming "
                         "stores) or 0 (cached stores)")
    return codes[raw]


OVERSUBSCRIBED_SPIN_NS = 500
# ...and yields for this long before sleeping: a rank that is not running is queued behind
# the others, so waiting on-CPU for milliseconds only delays it
OVERSUBSCRIBED_YIELD_NS = 200_000


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cap_for(n: int) -> int:
    """Bytes per step (one slot): 1 MiB with 2 ranks on a host, 256 KiB up to 16, then
    64 KiB. Two ranks reduce half a step each, which stays in L2 at 1 MiB; the fewer
    steps save synchronisations (2 ranks, in place, 2-4 MiB: 8-13 % faster than with
    256 KiB steps). With 3 ranks the larger step was no faster here."""
    return 1 << 20 if n == 2 else 256 << 10 if n <= 16 else 64 << 10


SIG_WORDS = 3  # int64 words of a call's signature (signature.py), two of them per header


def header_bytes(n: int) -> int:
    """One rank's counter, two signatures (the mismatch check's, by epoch parity) and
    per-rank sleeper flags in whole cache lines, then one more line for the CPU the rank
    last ran on (the engine's waits read it)."""
    return waits.header_bytes(n + 2 * SIG_WORDS) + 64


def engine(node_comm: MPI.Intracomm | None, fallback):
    """``(engine, window)``: over ``node_comm`` (collective over it; ranks of one host),
    or, with ``node_comm=None``, an engine for the recorder only (window None)."""
    if node_comm is None:
        return _fastshm.Engine(0, 1, (), 0, 64, None, fallback, np.empty_like, np.ndarray), None
    n, me = node_comm.Get_size(), node_comm.Get_rank()
    cap, hdr = cap_for(n), header_bytes(n)
    streaming = stream_mode()  # refused on every rank before any collective step
    win = MPI.Win.Allocate_shared(hdr + 2 * cap, 1, comm=node_comm)
    win.Lock_all(MPI.MODE_NOCHECK)
    addrs = []
    for k in range(n):
        buf, _ = win.Shared_query(k)
        addrs.append(np.frombuffer(buf, dtype=np.uint8, count=hdr + 2 * cap).ctypes.data)
    eng = _fastshm.Engine(me, n, tuple(addrs), cap, hdr, win, fallback, np.empty_like,
                          np.ndarray)  # zeroes this rank's header
    eng.nt_mode = streaming
    if n > usable_cpus():
        # More ranks than cores: a spinning rank holds the core the late rank needs
        # (3 ranks on 2 cores: 22 us per 8-byte call with a 20 us spin, 4 us with 0.5 us).
        eng.spin_ns = OVERSUBSCRIBED_SPIN_NS
        eng.yield_always = 1
        eng.yield_ns = OVERSUBSCRIBED_YIELD_NS
    win.Sync()
    node_comm.Barrier()  # every header is zeroed before anyone posts
    return eng, win


def free(win) -> None:
    if win is not None:
        try:
            win.Unlock_all()
            win.Free()
        except MPI.Exception:
            pass
