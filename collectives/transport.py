"""How a ``Comm`` moves allreduce data: the transports it sets up and the path per size.

Transports: the Python shared-memory reducer (shm.py) with, across hosts, the ranks of
the same local rank on every host (the inter-node step) and a ring over them; a ring
over all ranks; and the compiled engine (shm1.py), which holds the one-step shared-memory
paths on one host and the flight recorder's store. ``select_paths`` builds the table
(tuning.py) that picks a path per size: forced by the caller or environment, a fixed
size rule, or measured once per host and MPI and cached. ``via`` runs one allreduce
along a path.

The functions take the ``Comm`` they serve and set or read its transport attributes
(``_shm``, ``_cross_comm``, ``_cross_ring``, ``_ring``, ``_engine``, ``_engine_win``,
``_paths``): those stay plain attributes, read directly on the allreduce hot path.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from . import dp_exchange
from . import dtypes as _dt
from . import recorder as _rec
from . import shm1 as _shm1
from . import signature as _sig
from . import tuning as _tuning
from ._mpi import MPI
from .ring import Ring
from .shm import ShmReducer
from .sizes import env_bytes

DEFAULT_SHM_THRESHOLD = 256 * 1024
DEFAULT_SHM_CHUNK = 512 * 1024  # fits in L2/L3 between copy-in, reduce and copy-out

# Path bits of an allreduce signature, by path name.
PATH_BITS = {p: _sig.meta("allreduce", path=p) & ~_sig.meta("allreduce") for p in _tuning.PATHS}


def open_transports(c: Any, use_shm: bool) -> None:
    """Set up the shared-memory reducer and the rings this layout can use (collective)."""
    c._shm = c._cross_comm = c._cross_ring = c._ring = c._stream = None
    if use_shm and c.local_size > 1 and (c.nnodes == 1 or c._uniform_nodes):
        if c.nnodes > 1:
            # Ranks with the same local rank on every host: the inter-node step.
            c._cross_comm = c.mpi.Split(c.local_rank, c.node)
            c._cross_ring = Ring(c._cross_comm)
        c._shm = ShmReducer(c._node_comm, c._cross_comm, DEFAULT_SHM_CHUNK)
    if c.nnodes > 1:
        c._ring = Ring(c.mpi.Dup())


_SAID_NOT_BUILT: list = []  # the one line about a missing compiled engine, once printed


def open_engine(c: Any, fallback) -> None:
    """The compiled engine (shm1.py), when built: over the host's shared memory on one
    host with the shared-memory path on (collective over the host), else for the
    recorder's store only. ``fallback`` takes the allreduce calls it does not."""
    c._engine = c._engine_win = None
    if not _shm1.available():
        if _shm1._fastshm is None and c.rank == 0 and c.size > 1 and not _SAID_NOT_BUILT:
            # Once per process: an install without a C compiler still works, more slowly.
            _SAID_NOT_BUILT.append(True)
            print(f"dtrun.collectives: {_shm1.why_not()}: collectives take the Python and MPI paths",
                  file=sys.stderr, flush=True)
        return
    node = c._node_comm if c._shm is not None and c.nnodes == 1 else None
    c._engine, c._engine_win = _shm1.engine(node, fallback)
    if c._engine_win is not None:
        c._engine.set_signature(
            tuple(_sig.meta("allreduce", name) for name in _shm1.TYPE_NAMES),
            _sig.REDOP_SHIFT, _sig.PATH_SHIFT, c._sigs.engine_mismatch)
        c._engine.checking = int(c._sig_on)
        c._sigs.engine = c._engine


def attach_recorder(engine, rec: _rec.Recorder):
    """Let the compiled engine write ``rec`` itself; returns the store to call."""
    if engine is None:
        return rec.store
    addr = np.frombuffer(rec.ring, dtype=np.int64).ctypes.data
    descs = tuple(_rec.OP_BITS["allreduce"] | _rec.dtype_bits(name) for name in _shm1.TYPE_NAMES)
    flag = np.frombuffer(rec.header, dtype=np.int64).ctypes.data + 8 * _rec.INSIDE_WORD
    engine.set_recorder(addr, _rec.MASK, descs, (1 << _rec.COUNT_BITS) - 1, flag)
    return engine.note


def fast_limits(c: Any) -> None:
    """Tell the engine the sizes its allreduce takes without entering Python: those below
    the first size whose path is neither shm1 nor shm2 (none in DTRUN_CHECK mode, which
    Python does)."""
    eng = getattr(c, "_engine", None)
    if eng is None or c._engine_win is None:
        return
    if c._check:
        eng.set_fast((), ())
    else:
        eng.set_fast(*(c._paths.compiled_rows(ip) for ip in (False, True)))


def select_paths(c: Any, use_shm: bool, shm_threshold: int | None,
                 shm_chunk: int | None, path: str | None) -> _tuning.Table:
    """The allreduce path table (collective when it measures): see tuning.py."""
    tune = os.environ.get("DTRUN_TUNE", "1").strip().lower() or "1"
    if tune not in ("0", "1", "refresh"):  # the same on every rank (set with -x on a multi-host job)
        raise ValueError(f"DTRUN_TUNE={tune!r}: use 1 (measure, cached), 0 (the fixed rule) or refresh")
    _tuning.max_load()  # checked on every rank here: only rank 0 reads it, and must not fail alone
    cands = _tuning.candidates(c._shm is not None, c.nnodes, c._uniform_nodes,
                               c.local_size, compiled=c._engine_win is not None)
    if c.size == 1 or len(cands) == 1:
        why = ("one rank" if c.size == 1 else "DTRUN_SHM=0" if not use_shm else
               "no shared-memory peers on this host" if c.local_size == 1 else
               "hosts with different rank counts")
        return _tuning.Table.fixed("mpi", 0, 0, f"only mpi applies ({why})")
    forced = path or os.environ.get("DTRUN_ALLREDUCE_PATH", "").strip()
    if forced:
        return _forced(forced, bool(path), cands, shm_chunk)
    table = _rule(c, tune, shm_threshold, shm_chunk)
    if table is not None:
        return table
    return _tuning.calibrated(c.mpi, c.host, c.local_size, c.nnodes, _tuning.timed(cands),
                              lambda *a: calibration_run(c, *a), refresh=tune == "refresh",
                              tick=_calibration_tick(c))


def _calibration_tick(c):
    """After each size the calibration measured: one flight-recorder entry (a float32
    allreduce of that size, which is what it ran), so a hang watch sees the seconds a
    calibration across hosts takes as progress, not as a hang. The Comm forgets these
    entries once the table is made (``restart_recorder``)."""
    store = c._rec_store  # the compiled engine's when it writes the recorder, else Python's
    if store is None:
        return None
    bits = _rec.OP_BITS["allreduce"] | _rec.dtype_bits("float32")
    count_max = (1 << _rec.COUNT_BITS) - 1
    return lambda nbytes: store(bits | min(nbytes // 4, count_max))


def _chunk(shm_chunk: int | None) -> int:
    return env_bytes("DTRUN_SHM_CHUNK", DEFAULT_SHM_CHUNK) if shm_chunk is None else int(shm_chunk)


def _forced(forced: str, by_arg: bool, cands: list, shm_chunk: int | None) -> _tuning.Table:
    """One path at every size, as ``path=`` or ``DTRUN_ALLREDUCE_PATH`` asks."""
    origin = f"path={forced!r}" if by_arg else f"env DTRUN_ALLREDUCE_PATH={forced}"
    valid = {p for p, _ in cands}
    if forced not in valid:
        raise ValueError(f"{origin}: this layout offers {', '.join(sorted(valid))}")
    return _tuning.Table.fixed(forced, 0, _chunk(shm_chunk), origin)


def _rule(c: Any, tune: str, shm_threshold: int | None,
          shm_chunk: int | None) -> _tuning.Table | None:
    """The fixed size rule (shared memory at or above a threshold) when a threshold or
    chunk is given or ``DTRUN_TUNE=0``; None: measure instead."""
    env_t = os.environ.get("DTRUN_SHM_THRESHOLD", "").strip()
    env_c = os.environ.get("DTRUN_SHM_CHUNK", "").strip()
    if shm_threshold is None and shm_chunk is None and not env_t and not env_c and tune != "0":
        return None
    threshold = (env_bytes("DTRUN_SHM_THRESHOLD", DEFAULT_SHM_THRESHOLD)
                 if shm_threshold is None else int(shm_threshold))
    chunk = _chunk(shm_chunk)
    given = [name for name, v in (("shm_threshold", shm_threshold), ("shm_chunk", shm_chunk))
             if v is not None]
    given += [f"env {name}={v}" for name, v in (("DTRUN_SHM_THRESHOLD", env_t),
                                                ("DTRUN_SHM_CHUNK", env_c)) if v]
    source = ", ".join(given) if given else "built-in default (DTRUN_TUNE=0)"
    if c._shm is None:  # the rule is about shared memory, which does not apply
        return _tuning.Table.fixed("mpi", 0, 0, f"{source} (no shared memory here)")
    shm_path = "shm+hierarchical" if c._cross_comm is not None else "shm"
    return _tuning.Table.fixed(shm_path, threshold, chunk, source)


def calibration_run(c: Any, cand: tuple[str, int], src: np.ndarray, dst: np.ndarray,
                    inplace: bool) -> None:
    """One float32 sum allreduce of ``src`` into ``dst`` along candidate path ``cand``."""
    t, mop, kern, finish, _, _ = c._redop(src, _dt.SUM, "allreduce")
    # Timed with the signature it carries in use, as every call pays it.
    sig = (c._sigs.meta(src.dtype, _dt.SUM) | PATH_BITS[cand[0]], src.size, 0) \
        if c._sig_on else None
    via(c, cand[0], cand[1], src, dst, inplace, t, mop, kern, finish, _dt.SUM, sig)


def via(c: Any, path: str, chunk: int, src: np.ndarray, dst: np.ndarray, inplace: bool,
        t, mop, kern, finish, canon: str, sig: tuple | None = None) -> None:
    """Allreduce ``src`` into ``dst`` (the same array when ``inplace``) along ``path``;
    ``sig``: the signature the first exchange carries (None: no check)."""
    if path == "shm1" or path == "shm2":
        # The compiled engine, whose first synchronisation carries the signature; a
        # dtype it does not reduce (float16, bfloat16, complex) takes the Python
        # shared-memory path after the same check (a rank of another dtype may be in
        # the engine: it meets this one there).
        if c._engine.reduce(src, dst, canon, path == "shm2", sig):
            return
        path, chunk = "shm", DEFAULT_SHM_CHUNK
    if sig is not None:
        c._sigs.light(sig, "allreduce")
    if path == "stream":
        if stream(c, src, dst, inplace, canon, finish):
            return
        path = "mpi"  # a dtype or op it does not take, or no ring
    if path == "mpi":
        c.mpi.Allreduce(MPI.IN_PLACE if inplace else [src, t], [dst, t], mop)
        if finish is not None:
            finish(dst)
    elif path == "ring":
        c._ring.allreduce(src, dst, kern, finish)
    else:  # shm, shm+hierarchical, shm+ring
        c._shm.allreduce(src, dst, kern, t, mop, finish, chunk,
                         c._cross_ring if path == "shm+ring" else None)


# What the streaming ring sums with NumPy's own add (fast for these; float16 is not).
STREAM_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))


def stream(c: Any, src: np.ndarray, dst: np.ndarray, inplace: bool, canon: str,
           finish) -> bool:
    """Allreduce across hosts along the streaming TCP ring (``dp_exchange.HostExchange``:
    a sum within each host, one rank per host on the ring, then a broadcast within the
    host). Opened on the first call that takes it (collective: the signature check
    before has shown that every rank is in this call). False: not for this dtype or op,
    or no ring (it could not connect; rank 0 said why once): the caller takes MPI's
    allreduce instead, as every rank does (so a calibration then times MPI for it)."""
    if canon not in (_dt.SUM, _dt.AVG) or src.dtype not in STREAM_DTYPES:
        return False
    ex = c._stream
    if ex is None:
        ex = c._stream = _open_stream(c)
    if ex is False:
        return False
    if not inplace:
        np.copyto(dst, src)
    flat = dst.reshape(-1)
    ex.wait(ex.start(flat, None), flat)
    if finish is not None:
        finish(dst)
    return True


def _open_stream(c: Any):
    # A malformed DTRUN_DP_RING_PORTS would stop only the hosts' leaders, in the middle of
    # the collective opening: refuse it on every rank first.
    try:
        dp_exchange.ring_ports(os.environ.get("DTRUN_DP_RING_PORTS"))
        problem = ""
    except ValueError as e:
        problem = str(e)
    problems = [p for p in c.mpi.allgather(problem) if p]
    if problems:
        raise ValueError(problems[0] if problem else problems[0] + " (on another rank)")
    add = lambda dst, src: np.add(dst, src, out=dst)  # noqa: E731
    scale = lambda x, factor: np.multiply(x, factor, out=x)  # noqa: E731
    ex = dp_exchange.open_exchange(c, add, scale, np.copyto, what="allreduces along the stream path")
    return False if ex is None else ex


def close_stream(c: Any) -> None:
    """Close the streaming ring, if one is open (collective over the host)."""
    if c._stream:
        c._stream.close()
    c._stream = None


def restart_recorder(c) -> None:
    """Empty the flight recorder after calibration: the program's first collective is #1
    in every report, whatever the calibration recorded."""
    if c._recorder is None:
        return
    engine = c._engine if (c._engine is not None and c._rec_store == c._engine.note) else None
    c._recorder.restart(engine)
