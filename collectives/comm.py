"""The communicator: buffer-based collectives on NumPy, PyTorch and GPU arrays.

Every operation uses mpi4py's uppercase (buffer) calls, never pickling. NumPy arrays
take the fast path (one ``type() is`` test, one dict lookup, the MPI call); PyTorch
CPU tensors are viewed as NumPy zero-copy; GPU arrays go to ``collectives.gpu``.

What is checked, and when:

* always (local, costs nothing): unsupported dtype, non-contiguous arrays, an ``out``
  of the wrong shape/dtype, lengths that ``size`` does not divide (scatter,
  reduce_scatter, alltoall), ops that make no sense for the dtype (average of ints).
* always in ``gatherv``/``allgatherv``: dtype and trailing shape agree on all ranks
  (the per-rank lengths are exchanged anyway, the signature rides along).
* always, across ranks (unless ``DTRUN_CHECK=0``): each collective's signature
  (operation, dtype, element count, reduction op, root, allreduce path; for
  grouped_allreduce the number of arrays and each one's dtype and count), carried in
  the first exchange every path makes (signature.py): beside the counter of the
  compiled engine's first synchronisation on one host (free for the shm1/shm2 paths;
  one shared-memory synchronisation before any other path, so a rank on another path
  meets it), else one 48-byte MPI allreduce before the call. Ranks that disagree all
  raise ``MismatchError`` naming what each passed, before any data moves. Non-blocking
  calls compare through an ``Iallgather`` checked at ``wait()``: a non-blocking call
  against a blocking one is not detected (MPI forbids the pairing).
* with ``DTRUN_CHECK=1`` (or ``Comm(check=True)``): before each collective the
  ranks also allgather (operation, dtype, element count, op, root) and every rank raises
  ``MismatchError`` naming the ranks that disagree (a whole extra collective per call).
"""

from __future__ import annotations

import operator
import os
import socket
from typing import Any, Sequence

import numpy as np

from . import dtypes as _dt
from ._mpi import MPI
from .errors import (CollectiveError, MismatchError, MPIError, NotContiguousError,
                     OverlapError, ReadOnlyError, ShapeError, UnsupportedDtypeError)
from . import recorder as _rec
from . import signature as _sig
from .handle import Handle
from . import tuning as _tuning
from .ring import Ring
from . import shm1 as _shm1
from .shm import SINGLE_STEP_MAX, ShmReducer
from .sizes import env_bytes

SUM, PROD, MIN, MAX, AVG = _dt.SUM, _dt.PROD, _dt.MIN, _dt.MAX, _dt.AVG
IN_PLACE = MPI.IN_PLACE
ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG

DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024
# grouped_allreduce: an array this large is reduced on its own, in place (packing it
# costs two copies and saves a per-call overhead it does not notice), and fused buffers
# stay at most SINGLE_STEP_MAX, so they are packed straight into shared memory and stay
# in cache (a 64 MiB buffer ran 4x slower than its 4 arrays reduced one by one).
FUSE_ALONE_BYTES = 1 << 20
DEFAULT_SHM_THRESHOLD = 256 * 1024
DEFAULT_SHM_CHUNK = 512 * 1024  # fits in L2/L3 between copy-in, reduce and copy-out

_OP_CODES = {name: i for i, name in enumerate(
    ["allreduce", "reduce", "broadcast", "scatter", "gather", "allgather", "gatherv",
     "allgatherv", "reduce_scatter", "alltoall", "barrier", "grouped_allreduce"])}
_REDOP_CODES = {None: 0, SUM: 1, PROD: 2, MIN: 3, MAX: 4, AVG: 5}
_REC_MASK = _rec.MASK
_INSIDE = _rec.INSIDE_WORD
_REC_COUNT_MAX = (1 << _rec.COUNT_BITS) - 1
# The process's first Comm over MPI.COMM_WORLD owns the flight recorder.
_REC_TAKEN = [False]


def _same_items(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether ``a`` and ``b`` hold the same objects, in order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_off(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("0", "false", "no", "off")


# Path bits of an allreduce signature, by path name.
_PATH_BITS = {p: _sig.meta("allreduce", path=p) & ~_sig.meta("allreduce") for p in _tuning.PATHS}


class _Checked:
    """A non-blocking collective whose signature exchange (an ``Iallgather`` started just
    before it) is checked before its own completion is waited for: a mismatch raises on
    every rank's ``wait()``/``test()`` instead of waiting for data that never matches."""

    __slots__ = ("comm", "sig_req", "table", "data", "op", "checked")

    def __init__(self, comm, sig_req, table, data, op: str) -> None:
        self.comm, self.sig_req, self.table, self.data, self.op = comm, sig_req, table, data, op
        self.checked = False

    def _verdict(self) -> None:
        self.checked = True
        t = self.table
        if (t != t[0]).any():
            raise self.comm._mismatch(self.op, t.tolist())

    def Wait(self) -> None:  # noqa: N802
        if not self.checked:
            self.sig_req.Wait()
            self._verdict()
        self.data.Wait()

    def Test(self) -> bool:  # noqa: N802
        if not self.checked:
            if not self.sig_req.Test():
                return False
            self._verdict()
        return self.data.Test()


class Comm:
    """A communicator over a group of ranks (wraps an ``mpi4py.MPI.Intracomm``).

    Creating one is collective over ``mpi_comm``. Attributes: ``rank``, ``size``,
    ``local_rank``/``local_size`` (within this host), ``node``/``nnodes`` (index of
    this host among the hosts of the communicator), ``host``, ``mpi`` (the mpi4py
    communicator).

    Args:
        mpi_comm: the MPI communicator (default ``MPI.COMM_WORLD``).
        check: exchange a signature before each collective to catch mismatches
            (default: env ``DTRUN_CHECK``).
        shm: use the shared-memory allreduce on hosts with several ranks (default:
            on, unless env ``DTRUN_SHM=0``).
        node_comm: override how ranks are grouped into nodes (tests use it to emulate
            several hosts on one machine). Must be a split of ``mpi_comm`` whose
            members share memory.
        shm_threshold: smallest allreduce (bytes) that takes the shared-memory path
            (default: env ``DTRUN_SHM_THRESHOLD``, else measured: see below).
        shm_chunk: bytes per rank and step of the shared-memory path (default: env
            ``DTRUN_SHM_CHUNK``, else measured).
        path: take this allreduce path at every size ("mpi", "shm", "shm+hierarchical",
            "shm+ring", "ring"; default: env ``DTRUN_ALLREDUCE_PATH``, else measured).
        signatures: compare each collective's signature in its first exchange (default:
            on, unless env ``DTRUN_CHECK=0``); see the module doc.

    The allreduce path for each size (MPI, shared memory with a chunk size,
    hierarchical, ring) is measured at creation on hosts where there is a choice, and
    cached per host and MPI (``tuning.py``); ``allreduce_path(nbytes)`` says which one
    a size takes and ``allreduce_reason(nbytes)`` why. A threshold or chunk given here
    or in the environment fixes the rule instead (shm at or above the threshold).
    """

    def __init__(self, mpi_comm: MPI.Intracomm | None = None, *, check: bool | None = None,
                 shm: bool | None = None, node_comm: MPI.Intracomm | None = None,
                 shm_threshold: int | None = None, shm_chunk: int | None = None,
                 path: str | None = None, signatures: bool | None = None) -> None:
        comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.mpi = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.host = MPI.Get_processor_name() or socket.gethostname()
        if node_comm is None:
            node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self._node_comm = node_comm
        self.local_rank = node_comm.Get_rank()
        self.local_size = node_comm.Get_size()
        # Node index: hosts ordered by their lowest rank. One small allgather at setup.
        leader = np.array([self.rank], dtype=np.int64)
        node_comm.Allreduce(IN_PLACE, leader, op=MPI.MIN)
        info = np.array([leader[0], self.local_size], dtype=np.int64)
        table = np.empty((self.size, 2), dtype=np.int64)
        comm.Allgather(info, table)
        leaders = sorted(set(int(v) for v in table[:, 0]))
        self.node = leaders.index(int(leader[0]))
        self.nnodes = len(leaders)
        self._uniform_nodes = len(set(int(v) for v in table[:, 1])) == 1

        self._check = _env_flag("DTRUN_CHECK") if check is None else bool(check)
        self._sig_on = (not _env_off("DTRUN_CHECK")) if signatures is None else bool(signatures)
        self._sigbuf = np.zeros(6, dtype=np.int64)  # [w0, w1, w2, -w0, -w1, -w2]
        self._sigbase: dict[tuple, int] = {}
        self._group_pending: Sequence[Any] | None = None  # grouped_allreduce's list, for messages
        self.fusion_threshold = env_bytes("DTRUN_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD)
        use_shm = (os.environ.get("DTRUN_SHM", "1").strip() != "0") if shm is None else shm
        self._shm: ShmReducer | None = None
        self._cross_comm: MPI.Intracomm | None = None
        self._cross_ring: Ring | None = None  # the inter-node step of "shm+ring"
        self._ring: Ring | None = None        # "ring": all ranks, on a private Dup
        if use_shm and self.local_size > 1 and (self.nnodes == 1 or self._uniform_nodes):
            if self.nnodes > 1:
                # Ranks with the same local rank on every host: the inter-node step.
                self._cross_comm = comm.Split(self.local_rank, self.node)
                self._cross_ring = Ring(self._cross_comm)
            self._shm = ShmReducer(node_comm, self._cross_comm, DEFAULT_SHM_CHUNK)
        if self.nnodes > 1:
            self._ring = Ring(comm.Dup())
        # The compiled engine (shm1.py): the one-step shared-memory path on one host, and
        # the recorder's store. Its allreduce() falls back to this class's for what it
        # does not take.
        self._engine = self._engine_win = None
        # grouped_allreduce's plan check: the same arrays, in order (compiled: ~25x faster)
        self._same_items = _shm1.same_items if _shm1.available() else _same_items
        if _shm1.available():
            node = node_comm if self._shm is not None and self.nnodes == 1 else None
            self._engine, self._engine_win = _shm1.engine(node, Comm.allreduce.__get__(self))
            if self._engine_win is not None:
                self._engine.set_signature(
                    tuple(_sig.meta("allreduce", name) for name in _shm1.TYPE_NAMES),
                    _sig.REDOP_SHIFT, _sig.PATH_SHIFT, self._engine_mismatch)
                self._engine.checking = int(self._sig_on)
        self._opcache: dict[tuple[np.dtype, str], tuple] = {}
        self._fusion_bufs: dict[np.dtype, np.ndarray] = {}
        self._group_plans: dict[tuple, tuple] = {}
        self._gpu = None  # collectives.gpu.GpuContext, created on first GPU array
        self._error_ctx: dict[str, _MpiErrors] = {}
        self._seq = 0
        self._rec = None  # ring view of the flight recorder, when this Comm owns it
        self._rec_map = None
        self._hdr = None  # its header: word INSIDE_WORD is 1 while inside a blocking collective
        self._paths = self._select_paths(use_shm, shm_threshold, shm_chunk, path)
        self._rec_store = self._py_rec_store
        if not _REC_TAKEN[0] and comm == MPI.COMM_WORLD:
            ring = _rec.open_ring(self.rank)
            if ring is not None:
                _REC_TAKEN[0] = True
                self._rec_map, self._rec = ring
                self._hdr = _rec.header(self._rec_map)
                if self._engine is not None:
                    addr = np.frombuffer(self._rec, dtype=np.int64).ctypes.data
                    descs = tuple(_rec.OP_BITS["allreduce"] | _rec.dtype_bits(name)
                                  for name in _shm1.TYPE_NAMES)
                    flag = np.frombuffer(self._hdr, dtype=np.int64).ctypes.data + 8 * _INSIDE
                    self._engine.set_recorder(addr, _REC_MASK, descs, _REC_COUNT_MAX, flag)
                    self._rec_store = self._engine.note
        if self._engine_win is not None:
            self._fast_limits()
            # The instance's allreduce is the engine's: NumPy calls it takes run in C with
            # no Python frame; the rest go to Comm.allreduce.
            self.allreduce = self._engine.allreduce

    @property
    def check(self) -> bool:
        """DTRUN_CHECK mode: ranks compare each collective's signature first."""
        return self._check

    @check.setter
    def check(self, value: bool) -> None:
        self._check = bool(value)
        self._fast_limits()

    @property
    def signatures(self) -> bool:
        """Whether each collective's signature rides in its first exchange (on unless
        ``DTRUN_CHECK=0``). Collective in effect: set it alike on every rank."""
        return self._sig_on

    @signatures.setter
    def signatures(self, value: bool) -> None:
        self._sig_on = bool(value)
        if self._engine is not None and self._engine_win is not None:
            self._engine.checking = int(self._sig_on)

    def _fast_limits(self) -> None:
        """The sizes the compiled allreduce takes without entering Python: those below the
        first size whose path is neither shm1 nor shm2 (none in DTRUN_CHECK mode, which
        Python does)."""
        eng = getattr(self, "_engine", None)
        if eng is None or self._engine_win is None:
            return
        if self._check:
            eng.set_fast((), ())
        else:
            eng.set_fast(*(self._paths.compiled_rows(ip) for ip in (False, True)))

    def _select_paths(self, use_shm: bool, shm_threshold: int | None,
                      shm_chunk: int | None, path: str | None) -> "_tuning.Table":
        """The allreduce path table (collective when it measures): see tuning.py."""
        env = os.environ
        tune = env.get("DTRUN_TUNE", "1").strip().lower() or "1"
        if tune not in ("0", "1", "refresh"):  # the same on every rank: dtrun forwards the environment
            raise ValueError(f"DTRUN_TUNE={tune!r}: use 1 (measure, cached), 0 (the fixed rule) or refresh")
        _tuning.max_load()  # checked on every rank here: only rank 0 reads it, and must not fail alone
        cands = _tuning.candidates(self._shm is not None, self.nnodes, self._uniform_nodes,
                                   self.local_size, compiled=self._engine_win is not None)
        if self.size == 1 or len(cands) == 1:
            why = ("one rank" if self.size == 1 else "DTRUN_SHM=0" if not use_shm else
                   "no shared-memory peers on this host" if self.local_size == 1 else
                   "hosts with different rank counts")
            return _tuning.Table.fixed("mpi", 0, 0, f"only mpi applies ({why})")
        shm_path = "shm+hierarchical" if self._cross_comm is not None else "shm"
        forced = path or env.get("DTRUN_ALLREDUCE_PATH", "").strip()
        if forced:
            origin = f"path={forced!r}" if path else f"env DTRUN_ALLREDUCE_PATH={forced}"
            valid = {p for p, _ in cands}
            if forced not in valid:
                raise ValueError(f"{origin}: this layout offers {', '.join(sorted(valid))}")
            chunk = env_bytes("DTRUN_SHM_CHUNK", DEFAULT_SHM_CHUNK) if shm_chunk is None \
                else int(shm_chunk)
            return _tuning.Table.fixed(forced, 0, chunk, origin)
        env_t, env_c = env.get("DTRUN_SHM_THRESHOLD", "").strip(), env.get("DTRUN_SHM_CHUNK", "").strip()
        if shm_threshold is not None or shm_chunk is not None or env_t or env_c or tune == "0":
            threshold = (env_bytes("DTRUN_SHM_THRESHOLD", DEFAULT_SHM_THRESHOLD)
                         if shm_threshold is None else int(shm_threshold))
            chunk = env_bytes("DTRUN_SHM_CHUNK", DEFAULT_SHM_CHUNK) if shm_chunk is None \
                else int(shm_chunk)
            given = [name for name, v in (("shm_threshold", shm_threshold), ("shm_chunk", shm_chunk))
                     if v is not None]
            given += [f"env {name}={v}" for name, v in (("DTRUN_SHM_THRESHOLD", env_t),
                                                        ("DTRUN_SHM_CHUNK", env_c)) if v]
            source = ", ".join(given) if given else "built-in default (DTRUN_TUNE=0)"
            if self._shm is None:  # the rule is about shared memory, which does not apply
                return _tuning.Table.fixed("mpi", 0, 0, f"{source} (no shared memory here)")
            return _tuning.Table.fixed(shm_path, threshold, chunk, source)
        return _tuning.calibrated(self.mpi, self.host, self.local_size, self.nnodes, cands,
                                  self._calibration_run, refresh=tune == "refresh")

    def _calibration_run(self, cand: tuple[str, int], src: np.ndarray, dst: np.ndarray,
                         inplace: bool) -> None:
        """One float32 sum allreduce of ``src`` into ``dst`` along candidate path ``cand``."""
        t, mop, kern, finish, _, _ = self._redop(src, SUM, "allreduce")
        # Timed with the signature it carries in use, as every call pays it.
        sig = (self._sig_meta(src.dtype, SUM) | _PATH_BITS[cand[0]], src.size, 0) \
            if self._sig_on else None
        self._via(cand[0], cand[1], src, dst, inplace, t, mop, kern, finish, SUM, sig)

    def _via(self, path: str, chunk: int, src: np.ndarray, dst: np.ndarray, inplace: bool,
             t, mop, kern, finish, canon: str, sig: tuple | None = None) -> None:
        """Allreduce ``src`` into ``dst`` (the same array when ``inplace``) along ``path``;
        ``sig``: the signature the first exchange carries (None: no check)."""
        if path == "shm1" or path == "shm2":
            # The compiled engine, whose first synchronisation carries the signature; a
            # dtype it does not reduce (float16, bfloat16, complex) takes the Python
            # shared-memory path after the same check (a rank of another dtype may be in
            # the engine: it meets this one there).
            if self._engine.reduce(src, dst, canon, path == "shm2", sig):
                return
            path, chunk = "shm", DEFAULT_SHM_CHUNK
        if sig is not None:
            self._light(sig, "allreduce")
        if path == "mpi":
            self.mpi.Allreduce(IN_PLACE if inplace else [src, t], [dst, t], mop)
            if finish is not None:
                finish(dst)
        elif path == "ring":
            self._ring.allreduce(src, dst, kern, finish)
        else:  # shm, shm+hierarchical, shm+ring
            self._shm.allreduce(src, dst, kern, t, mop, finish, chunk,
                                self._cross_ring if path == "shm+ring" else None)

    # ------------------------------------------------------------------ helpers
    def __repr__(self) -> str:
        return (f"<collectives.Comm rank {self.rank}/{self.size} local {self.local_rank}/"
                f"{self.local_size} node {self.node}/{self.nnodes} host {self.host}>")

    def _err(self, cls, op: str, problem: str) -> CollectiveError:
        return cls(op, self.rank, problem)

    def _mpi_error(self, op: str, exc: Exception) -> CollectiveError:
        text = exc.Get_error_string() if isinstance(exc, MPI.Exception) else str(exc)
        hint = ""
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_TRUNCATE:
            hint = (" — a receive buffer is smaller than the message: ranks passed "
                    "different lengths; run with DTRUN_CHECK=1 to find which")
        return MPIError(op, self.rank, f"MPI error: {text}{hint}")

    def _type(self, x: np.ndarray, op: str) -> MPI.Datatype:
        """Validate a NumPy buffer; return its MPI datatype."""
        t = _dt._MPI_TYPE.get(x.dtype)
        if t is None:
            raise self._err(UnsupportedDtypeError, op,
                            f"dtype {x.dtype} is not supported; use one of "
                            f"{', '.join(_dt.supported_dtypes())}")
        if not x.flags.c_contiguous:
            raise self._err(NotContiguousError, op,
                            f"array of shape {x.shape} with strides {x.strides} is not "
                            "C-contiguous; pass np.ascontiguousarray(x) (or x.contiguous() "
                            "for a tensor)")
        return t

    def _redop(self, x: np.ndarray, op: str, opname: str) -> tuple:
        """(mpi type, mpi op, kernel, average-finisher, canonical op, recorder bits of an
        allreduce of this dtype) for dtype and op; cached."""
        try:
            return self._opcache[(x.dtype, op)]
        except (KeyError, TypeError):
            pass
        canon = _dt.OP_ALIASES.get(str(op).lower()) if isinstance(op, str) else None
        if canon is None:
            raise self._err(CollectiveError, opname,
                            f"unknown reduction op {op!r}; use one of {', '.join(_dt.REDUCE_OPS)}")
        t = self._type(x, opname)
        problem = _dt.reduce_problem(x.dtype, canon)
        if problem:
            raise self._err(UnsupportedDtypeError, opname, problem)
        entry = (t, _dt.mpi_op(x.dtype, canon), _dt.kernel(x.dtype, canon),
                 _dt.divider(x.dtype, self.size) if canon == AVG else None, canon,
                 _rec.OP_BITS["allreduce"] | _rec.dtype_bits(_dt.dtype_name(x.dtype)))
        self._opcache[(x.dtype, op)] = entry
        return entry

    def _out(self, x: np.ndarray, out: Any, shape: tuple, op: str, xp=np,
             overlap_ok: bool = False) -> Any:
        """Allocate ``out`` or check the one given (shape, dtype, contiguity, writable, and
        not overlapping ``x`` unless ``overlap_ok``)."""
        if out is None:
            return xp.empty(shape, dtype=x.dtype)
        if out.dtype != x.dtype or tuple(out.shape) != tuple(shape):
            raise self._err(ShapeError, op,
                            f"out has shape {tuple(out.shape)} dtype {out.dtype}, expected "
                            f"shape {tuple(shape)} dtype {x.dtype}")
        if not out.flags.c_contiguous:
            raise self._err(NotContiguousError, op, "out is not C-contiguous")
        if xp is np and isinstance(out, np.ndarray):
            if not out.flags.writeable:
                raise self._err(ReadOnlyError, op, "out is read-only; pass a writable array")
            if not overlap_ok:
                self._no_overlap(x, out, op)
        return out

    def _no_overlap(self, x: np.ndarray, out: np.ndarray, op: str) -> None:
        """Refuse an ``out`` that shares memory with ``x`` without being it: the result
        would be computed from input the call has already overwritten. Both are
        C-contiguous, so overlapping bounds are overlapping memory (exact)."""
        if out is not x and np.may_share_memory(x, out):
            raise self._err(OverlapError, op,
                            "out overlaps x (they share memory but are not the same array); "
                            "pass out=x or inplace=True for in place, or a separate array")

    def _writable(self, x: np.ndarray, op: str, what: str = "x") -> None:
        """Refuse to write a result into a read-only array (e.g. one over ``bytes``)."""
        if not x.flags.writeable:
            raise self._err(ReadOnlyError, op,
                            f"{what} is read-only (e.g. np.frombuffer over bytes) and would "
                            "receive the result; pass a writable copy (x.copy())")

    def _rows(self, x: np.ndarray, op: str) -> int:
        """Rows per rank when axis 0 of ``x`` is split evenly over the ranks."""
        n = x.shape[0] if x.ndim else 1
        if n % self.size:
            raise self._err(ShapeError, op,
                            f"axis 0 has length {n}, which {self.size} ranks cannot split "
                            f"evenly; pad to a multiple of {self.size}")
        return n // self.size

    def _signature(self, opname: str, x: np.ndarray | None, redop: str | None = None,
                   root: int = -1) -> None:
        """DTRUN_CHECK mode: all ranks compare what they are about to call."""
        sig = np.array([
            _OP_CODES.get(opname, 99),
            -1 if x is None else x.dtype.num * 1000 + x.dtype.itemsize,
            -1 if x is None else x.size,
            _REDOP_CODES.get(_dt.OP_ALIASES.get(str(redop).lower()) if redop else None, 9),
            root,
        ], dtype=np.int64)
        table = np.empty((self.size, sig.size), dtype=np.int64)
        self.mpi.Allgather(sig, table)
        fields = ["operation", "dtype", "element count", "reduction op", "root"]
        diffs = []
        for i, name in enumerate(fields):
            col = table[:, i]
            if (col != col[0]).any():
                if name == "element count" and opname in ("gatherv", "allgatherv"):
                    continue
                if x is None and name in ("dtype", "element count"):
                    continue
                detail = ", ".join(f"rank {k}: {self._describe(name, int(v))}"
                                   for k, v in enumerate(col))
                diffs.append(f"{name} differs ({detail})")
        if diffs:
            rows = []
            for k in range(self.size):
                kind, dtype, count, redop, at = (self._describe(f, int(v)) for f, v in
                                                 zip(fields, table[k]))
                rows.append((_sig.meta(kind if kind in _sig.KINDS else "allreduce",
                                       None if x is None else dtype,
                                       redop if redop in _sig.REDOPS else None, None,
                                       int(table[k, 4])), int(table[k, 2]), 0))
            raise self._err(MismatchError, opname, "; ".join(diffs) + " — " + _sig.explain(rows))

    def _full_words(self, opname: str, words: tuple) -> None:
        """DTRUN_CHECK mode for a signature in words (grouped_allreduce): allgather every
        rank's and raise MismatchError on every rank when any differs."""
        mine = np.array(words, dtype=np.int64)
        table = np.empty((self.size, 3), dtype=np.int64)
        self.mpi.Allgather(mine, table)
        if (table != table[0]).any():
            raise self._mismatch(opname, table.tolist())

    @staticmethod
    def _describe(field: str, value: int) -> str:
        if field == "operation":
            return next((k for k, v in _OP_CODES.items() if v == value), str(value))
        if field == "dtype" and value >= 0:
            num, size = divmod(value, 1000)
            for d in _dt._MPI_TYPE:
                if d.num == num and d.itemsize == size:
                    return _dt.dtype_name(d)
        if field == "reduction op":
            return next((str(k) for k, v in _REDOP_CODES.items() if v == value), str(value))
        return str(value)

    def _sig_meta(self, dtype: np.dtype, canon: str | None, kind: str = "allreduce",
                  root: int = -1) -> int:
        """``w0`` of a signature (signature.py); cached per (kind, dtype, op, root)."""
        key = (kind, dtype, canon, root)
        w = self._sigbase.get(key)
        if w is None:
            w = self._sigbase[key] = _sig.meta(kind, None if dtype is None else
                                              _dt.dtype_name(dtype), canon, None, root)
        return w

    def _light(self, words: tuple, opname: str) -> None:
        """The signature check a path without its own carrier makes first: one
        synchronisation of the compiled engine on one host (a rank whose call took the
        engine meets it there), else a 48-byte MAX allreduce of the words and their
        negations (all equal iff max == -max of the negations)."""
        if self._engine_win is not None:
            self._engine.check(words)
            return
        if self.size == 1:
            return
        w0, w1, w2 = words
        buf = self._sigbuf
        buf[:] = (w0, w1, w2, -w0, -w1, -w2)
        self.mpi.Allreduce(IN_PLACE, buf, MPI.MAX)
        if buf[0] != -buf[3] or buf[1] != -buf[4] or buf[2] != -buf[5]:
            mine = np.array(words, dtype=np.int64)
            table = np.empty((self.size, 3), dtype=np.int64)
            self.mpi.Allgather(mine, table)
            raise self._mismatch(opname, table.tolist())

    def _sig_start(self, words: tuple) -> tuple:
        """The non-blocking form: (request, table) of an Iallgather of the words."""
        mine = np.array(words, dtype=np.int64)
        table = np.empty((self.size, 3), dtype=np.int64)
        return self.mpi.Iallgather(mine, table), table, mine

    def _engine_mismatch(self, rows: list) -> None:
        """The engine's callback when the ranks' signatures differ (one host: local ranks
        are the communicator's ranks): raise MismatchError on this rank."""
        kind = _sig.KINDS[(rows[self.local_rank][0] >> _sig.KIND_SHIFT) & 31] or "collective"
        raise self._mismatch(kind, rows)

    def _mismatch(self, opname: str, rows: list) -> MismatchError:
        """MismatchError naming every rank's signature (``rows[rank]``); for lists of
        grouped_allreduce arrays also the first array that differs (one more exchange,
        which every rank makes: they all see the same rows)."""
        text = ("ranks called with different arguments: " + _sig.explain(rows) +
                "; every rank must make the same collective calls, in the same order, with "
                "the same dtypes, element counts, ops and roots")
        kinds = {(int(r[0]) >> _sig.KIND_SHIFT) & 31 for r in rows}
        if kinds == {_sig.KINDS.index("grouped_allreduce")}:
            text += self._first_group_difference()
        return self._err(MismatchError, opname, text)

    def _first_group_difference(self) -> str:
        """Where the ranks' grouped_allreduce lists first differ (collective)."""
        arrays = self._group_pending or []
        mine = np.array([[_sig._DTYPE.get(_dt.dtype_name(a.dtype), 0), a.size] for a in arrays],
                        dtype=np.int64).reshape(-1, 2)
        lengths = np.empty(self.size, dtype=np.int64)
        self.mpi.Allgather(np.array([len(mine)], dtype=np.int64), lengths)
        table = np.empty((int(lengths.sum()), 2), dtype=np.int64)
        counts = [int(v) * 2 for v in lengths]
        displs = [sum(counts[:k]) for k in range(self.size)]
        self.mpi.Allgatherv(mine, [table, (counts, displs), MPI.INT64_T])
        starts = np.concatenate(([0], np.cumsum(lengths)))
        lists = [table[starts[k]:starts[k + 1]] for k in range(self.size)]
        for i in range(int(lengths.max()) if len(lengths) else 0):
            cells = [tuple(lst[i]) if i < len(lst) else None for lst in lists]
            if len(set(cells)) > 1:
                def show(c):
                    return "no such array" if c is None else \
                        f"{c[1]} x {_sig._DTYPES[c[0]] if c[0] < len(_sig._DTYPES) else '?'}"
                return (f"; first difference at array {i}: " +
                        ", ".join(f"rank {k}: {show(c)}" for k, c in enumerate(cells)))
        return ("; the arrays agree in dtype and count: the op or fusion_threshold "
                "differs")

    def _note(self, opname: str, x: np.ndarray | None, redop: str | None = None,
              root: int = -1) -> None:
        """Flight recorder: this rank starts collective ``opname`` (collectives/recorder.py)."""
        desc = _rec.OP_BITS.get(opname, 0) | _rec.root_bits(root)
        if x is not None:
            desc |= _rec.dtype_bits(_dt.dtype_name(x.dtype)) | min(x.size, _REC_COUNT_MAX)
        self._rec_store(desc)

    def _py_rec_store(self, desc: int) -> None:
        """The recorder's store without the compiled engine: desc, then the sequence number."""
        s = self._seq = self._seq + 1
        i = (s & _REC_MASK) << 1
        self._rec[i + 1] = desc
        self._rec[i] = s

    def _foreign(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Operations on non-NumPy arrays: torch CPU tensors, GPU arrays."""
        from . import arrays
        return arrays.dispatch(self, name, args, kwargs)

    # ---------------------------------------------------------------- structure
    def split(self, color: int | None, key: int = 0) -> "Comm | None":
        """Sub-communicator of the ranks with the same ``color`` (collective).

        Ranks passing ``color=None`` get None back. ``key`` orders ranks in the result.
        """
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else int(color), key)
        if sub == MPI.COMM_NULL:
            return None
        return Comm(sub, check=self.check, shm=self._shm is not None, signatures=self._sig_on)

    def split_by_node(self) -> "Comm":
        """Sub-communicator of the ranks on this host (collective)."""
        return Comm(self._node_comm.Dup(), check=self.check, shm=self._shm is not None,
                    signatures=self._sig_on)

    def allreduce_path(self, nbytes: int, inplace: bool = False) -> str:
        """Which path a host allreduce of ``nbytes`` takes: "mpi" (MPI_Allreduce), "shm"
        (shared memory), "shm+hierarchical" (shared memory within hosts, MPI between
        them), "shm+ring" (shared memory within hosts, a ring between them) or "ring"
        (a ring over all ranks). The same on every rank."""
        return self._paths.pick(int(nbytes), inplace)[0]

    def allreduce_reason(self, nbytes: int, inplace: bool = False) -> str:
        """Why ``allreduce_path(nbytes)``: the path, its chunk, and how it was chosen,
        e.g. "shm (chunk 512 KiB): calibrated on host/Open MPI v5.0.11 at … (cached):
        shm 1.80x mpi at 4 MiB out of place" or "…: env DTRUN_SHM_THRESHOLD=1M: …"."""
        return self._paths.explain(int(nbytes), inplace)

    def allreduce_paths(self) -> list[dict]:
        """The decision table: one row per measured size and variant (benchmarks print it)."""
        rows = []
        for ip in (0, 1):
            for size in _tuning.BUCKETS:
                path, chunk = self._paths.pick(size, bool(ip))
                rows.append({"size": size, "inplace": bool(ip), "path": path, "chunk": chunk,
                             "reason": self._paths.explain(size, bool(ip))})
        return rows

    def shm_barrier_ns(self, iters: int = 5000) -> float | None:
        """Mean nanoseconds per barrier of this host's ranks through the shared-memory
        engine (the synchronisation every shared-memory step pays), or None without one.
        Collective over the host's ranks. Benchmarks print it: on a VM it moves with
        where the vCPUs run, and the small-size figures move with it."""
        if self._engine_win is None:
            return None
        return self._engine.barrier_ns(int(iters))

    def free(self) -> None:
        """Release the shared-memory window (collective over the node) and the cached
        grouped_allreduce plans (which hold references to the arrays they cover)."""
        for plan in self._group_plans.values():
            self._free_plan(plan)
        self._group_plans.clear()
        if self._shm is not None:
            self._shm.free()
            self._shm = None
        if self._engine_win is not None:
            self.__dict__.pop("allreduce", None)  # back to Comm.allreduce (breaks the cycle)
            self._engine.set_fast((), ())  # a bound method kept from before falls back too
            _shm1.free(self._engine_win)
            self._engine_win = None
            if self._rec_store != self._engine.note:
                self._engine = None
        self._paths = _tuning.Table.fixed("mpi", 0, 0, "freed")

    # ---------------------------------------------------------------- running an op
    def _errors(self, op: str) -> "_MpiErrors":
        """Context manager: an ``MPI.Exception`` inside becomes MPIError naming ``op``."""
        ctx = self._error_ctx.get(op)
        if ctx is None:
            ctx = self._error_ctx[op] = _MpiErrors(self, op)
        return ctx

    def _finisher(self, finish, xp):
        """What completes a reduction's result in place (an average's division), for ``xp``."""
        if finish is None or xp is np:
            return finish
        n = self.size
        return lambda r: xp.true_divide(r, n, out=r)

    def _run(self, opname: str, c: "_Op", sig: tuple | None = None) -> Any:
        """The blocking form of a set-up collective: compare ``sig`` (signature words),
        call MPI, complete the result."""
        call, args, result, finish = c
        h = self._hdr  # the recorder's flag: this rank is inside a collective (waiting, mostly)
        if h is not None:
            h[_INSIDE] = 1
        try:
            if sig is not None and self._sig_on:
                self._light(sig, opname)
            try:
                getattr(self.mpi, call)(*args)
            except MPI.Exception as e:  # the one translation for every collective (hot path: no `with`)
                raise self._mpi_error(opname, e) from None
        finally:
            if h is not None:
                h[_INSIDE] = 0
        if finish is not None and result is not None:
            finish(result)
        return result

    def _start(self, opname: str, c: "_Op", keep: Any, sig: tuple | None = None) -> Handle:
        """The non-blocking form of the same set-up: MPI_I…, completed when the handle is;
        ``sig`` is compared through an Iallgather started first and checked at wait()."""
        call, args, result, finish = c
        post = None
        if finish is not None and result is not None:
            post = lambda r: (finish(r), r)[1]  # noqa: E731
        with self._errors(opname):
            checked = sig is not None and self._sig_on and self.size > 1
            if checked:
                sig_req, table, mine = self._sig_start(sig)
            request = getattr(self.mpi, _NONBLOCKING[call])(*args)
        if checked:
            request = _Checked(self, sig_req, table, request, opname)
            keep = (keep, mine)
        return Handle(request, result, post, keep=keep, op=opname)

    # ---------------------------------------------------------------- point to point
    def send(self, x: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of array ``x`` to rank ``dest``."""
        if type(x) is not np.ndarray:
            return self._foreign("send", x, dest, tag)
        t = self._type(x, "send")
        with self._errors("send"):
            self.mpi.Send([x, t], dest, tag)

    def recv(self, out: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Any:
        """Blocking receive into ``out`` (shape/dtype as sent); returns ``out``."""
        if type(out) is not np.ndarray:
            return self._foreign("recv", out, source, tag)
        t = self._type(out, "recv")
        with self._errors("recv"):
            self.mpi.Recv([out, t], source, tag)
        return out

    def isend(self, x: Any, dest: int, tag: int = 0) -> Handle:
        """Non-blocking send; ``wait()`` returns None. Do not modify ``x`` before."""
        if type(x) is not np.ndarray:
            return self._foreign("isend", x, dest, tag)
        t = self._type(x, "isend")
        with self._errors("isend"):
            return Handle(self.mpi.Isend([x, t], dest, tag), None, keep=x, op="isend")

    def irecv(self, out: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Handle:
        """Non-blocking receive into ``out``; ``wait()`` returns ``out``."""
        if type(out) is not np.ndarray:
            return self._foreign("irecv", out, source, tag)
        t = self._type(out, "irecv")
        with self._errors("irecv"):
            return Handle(self.mpi.Irecv([out, t], source, tag), out, op="irecv")

    def sendrecv(self, x: Any, dest: int, out: Any, source: int = ANY_SOURCE,
                 sendtag: int = 0, recvtag: int = ANY_TAG) -> Any:
        """Send ``x`` to ``dest`` and receive into ``out`` at once (no deadlock)."""
        if type(x) is not np.ndarray or type(out) is not np.ndarray:
            return self._foreign("sendrecv", x, dest, out, source, sendtag, recvtag)
        t, u = self._type(x, "sendrecv"), self._type(out, "sendrecv")
        with self._errors("sendrecv"):
            self.mpi.Sendrecv([x, t], dest, sendtag, [out, u], source, recvtag)
        return out

    # ---------------------------------------------------------------- collectives
    # Each collective with a non-blocking twin sets up once, in ``_<name>_op``: the
    # checks, the DTRUN_CHECK signature, the output array and the MPI arguments. The
    # blocking form runs that description with ``_run``, the ``i…`` form with ``_start``.
    def barrier(self) -> None:
        if self.check:
            self._signature("barrier", None)
        if self._rec is not None:
            self._note("barrier", None)
        h = self._hdr
        if h is not None:
            h[_INSIDE] = 1
        try:
            if self._sig_on:
                self._light((_sig.meta("barrier"), 0, 0), "barrier")
            with self._errors("barrier"):
                self.mpi.Barrier()
        finally:
            if h is not None:
                h[_INSIDE] = 0

    def set_wait_timing(self, on: bool) -> None:
        """Turn the recorder's "inside a collective" flag on or off (benchmarks compare both)."""
        self._hdr = _rec.header(self._rec_map) if on and self._rec_map is not None else None
        if self._engine is not None:
            self._engine.timing = int(bool(on))

    def allreduce(self, x: Any, op: str = SUM, out: Any = None, inplace: bool = False) -> Any:
        """Reduce ``x`` over all ranks with ``op`` (sum, prod, min, max, avg); every rank
        gets the result. Returns a new array, or ``out``, or ``x`` when ``inplace``."""
        if type(x) is not np.ndarray:
            return self._foreign("allreduce", x, op=op, out=out, inplace=inplace)
        # The NumPy case, flattened into one function: at 8 bytes each Python call level
        # costs about 5 % of an MPI_Allreduce (what _allreduce_op + _run do, inlined).
        try:
            t, mop, kern, finish, canon, rbits = self._opcache[(x.dtype, op)]
        except (KeyError, TypeError):
            t, mop, kern, finish, canon, rbits = self._redop(x, op, "allreduce")
        if not x.flags.c_contiguous:
            self._type(x, "allreduce")
        if self.check:
            self._signature("allreduce", x, canon)
        if self._rec is not None:  # flight recorder
            self._rec_store(rbits | min(x.size, _REC_COUNT_MAX))
        if inplace or out is x:
            if not x.flags.writeable:
                self._writable(x, "allreduce")
            out, send = x, IN_PLACE
        elif out is None:
            out, send = np.empty(x.shape, x.dtype), [x, t]
        else:
            if type(out) is not np.ndarray or out.dtype != x.dtype or out.shape != x.shape \
                    or not out.flags.c_contiguous:
                out = self._out(x, out, x.shape, "allreduce")  # raises, or a valid foreign out
            elif not out.flags.writeable:
                self._writable(out, "allreduce", "out")
            else:
                self._no_overlap(x, out, "allreduce")
            send = [x, t]
        paths = self._paths
        h = self._hdr  # the recorder's flag, as in _run
        if h is not None:
            h[_INSIDE] = 1
        try:
            if x.nbytes >= paths.floor:  # small messages: this one comparison
                path, chunk = paths.pick(x.nbytes, send is IN_PLACE)
                if path != "mpi":
                    sig = (self._sig_meta(x.dtype, canon) | _PATH_BITS[path], x.size, 0) \
                        if self._sig_on else None
                    with self._errors("allreduce"):
                        self._via(path, chunk, x, out, send is IN_PLACE, t, mop, kern, finish,
                                  canon, sig)
                    return out
            if self._sig_on:
                self._light((self._sig_meta(x.dtype, canon) | _PATH_BITS["mpi"], x.size, 0),
                            "allreduce")
            try:
                self.mpi.Allreduce(send, [out, t], mop)
            except MPI.Exception as e:
                raise self._mpi_error("allreduce", e) from None
        finally:
            if h is not None:
                h[_INSIDE] = 0
        if finish is not None:
            finish(out)
        return out

    def _allreduce_op(self, x, op, out, inplace, xp, opname) -> "_Op":
        t, mop, _, finish, canon, rbits = self._redop(x, op, opname)
        if not x.flags.c_contiguous:
            self._type(x, opname)
        if self.check:
            self._signature("allreduce", x, canon)
        if self._rec is not None:  # flight recorder
            self._rec_store(rbits | min(x.size, _REC_COUNT_MAX))
        if inplace or out is x:
            if xp is np:
                self._writable(x, opname)
            out, send = x, IN_PLACE
        else:
            out, send = self._out(x, out, x.shape, opname, xp), [x, t]
        return ("Allreduce", (send, [out, t], mop), out,
                finish if finish is None or xp is np else self._finisher(finish, xp))

    def _allreduce(self, x, op, out, inplace, xp, sig: Any = True):
        """``sig``: True: this call's own signature; None: none (a grouped_allreduce step
        after the first, whose list every rank already compared); or the words to carry."""
        c = self._allreduce_op(x, op, out, inplace, xp, "allreduce")
        paths = self._paths
        own = sig is True
        if own and not self._sig_on:
            sig = None
        if x.nbytes >= paths.floor and xp is np:  # small messages: one comparison
            out = c[2]
            path, chunk = paths.pick(x.nbytes, out is x)
            if path != "mpi":
                t, mop, kern, finish, canon, _ = self._redop(x, op, "allreduce")  # cached
                if own and sig is not None:
                    sig = (self._sig_meta(x.dtype, canon) | _PATH_BITS[path], x.size, 0)
                with self._errors("allreduce"):
                    self._via(path, chunk, x, out, out is x, t, mop, kern, finish, canon, sig)
                return out
        if own and sig is not None:
            canon = self._redop(x, op, "allreduce")[4]
            sig = (self._sig_meta(x.dtype, canon) | _PATH_BITS["mpi"], x.size, 0)
        return self._run("allreduce", c, sig)

    def iallreduce(self, x: Any, op: str = SUM, out: Any = None, inplace: bool = False) -> Handle:
        """Non-blocking allreduce (MPI_Iallreduce); ``wait()`` returns the result."""
        if type(x) is not np.ndarray:
            return self._foreign("iallreduce", x, op=op, out=out, inplace=inplace)
        return self._iallreduce(x, op, out, inplace, np)

    def _iallreduce(self, x, op, out, inplace, xp):
        c = self._allreduce_op(x, op, out, inplace, xp, "iallreduce")
        return self._start("iallreduce", c, x, self._words("allreduce", x, op))

    def _words(self, kind: str, x: Any, op: str | None = None, root: int = -1,
               count: int | None = None) -> tuple | None:
        """The signature words of collective ``kind`` on ``x`` (None when checks are off)."""
        if not self._sig_on:
            return None
        canon = _dt.OP_ALIASES.get(str(op).lower()) if op is not None else None
        dtype = None if x is None else x.dtype
        return (self._sig_meta(dtype, canon, kind, root),
                (0 if x is None else x.size) if count is None else count, 0)

    def reduce(self, x: Any, op: str = SUM, root: int = 0, out: Any = None,
               inplace: bool = False) -> Any:
        """Reduce ``x`` onto ``root``; returns the result on root, None elsewhere."""
        if type(x) is not np.ndarray:
            return self._foreign("reduce", x, op=op, root=root, out=out, inplace=inplace)
        return self._reduce(x, op, root, out, inplace, np)

    def _reduce_op(self, x, op, root, out, inplace, xp, opname) -> "_Op":
        t, mop, _, finish, canon, _ = self._redop(x, op, opname)
        self._type(x, opname)
        if self.check:
            self._signature("reduce", x, canon, root)
        if self._rec is not None:
            self._note("reduce", x, canon, root)
        if self.rank != root:
            return ("Reduce", ([x, t], None, mop, root), None, None)
        if inplace or out is x:
            if xp is np:
                self._writable(x, opname)
            out, send = x, IN_PLACE
        else:
            out, send = self._out(x, out, x.shape, opname, xp), [x, t]
        return ("Reduce", (send, [out, t], mop, root), out, self._finisher(finish, xp))

    def _reduce(self, x, op, root, out, inplace, xp):
        return self._run("reduce", self._reduce_op(x, op, root, out, inplace, xp, "reduce"),
                         self._words("reduce", x, op, root))

    def ireduce(self, x: Any, op: str = SUM, root: int = 0, out: Any = None,
                inplace: bool = False) -> Handle:
        """Non-blocking reduce; ``wait()`` returns the result on root, None elsewhere."""
        if type(x) is not np.ndarray:
            return self._foreign("ireduce", x, op=op, root=root, out=out, inplace=inplace)
        return self._start("ireduce", self._reduce_op(x, op, root, out, inplace, np, "ireduce"), x,
                           self._words("reduce", x, op, root))

    def broadcast(self, x: Any, root: int = 0, out: Any = None, inplace: bool = False) -> Any:
        """Copy root's ``x`` to every rank. Non-root ranks pass an array of the same
        shape/dtype (its values are ignored unless ``inplace``, where it is overwritten)."""
        if type(x) is not np.ndarray:
            return self._foreign("broadcast", x, root=root, out=out, inplace=inplace)
        return self._broadcast(x, root, out, inplace, np)

    def _broadcast_op(self, x, root, out, inplace, xp, opname) -> "_Op":
        t = self._type(x, opname)
        if self.check:
            self._signature("broadcast", x, None, root)
        if self._rec is not None:
            self._note("broadcast", x, None, root)
        if not (inplace or out is x):
            # copyto handles overlapping memory, so an out overlapping x is still correct
            out = self._out(x, out, x.shape, opname, xp, overlap_ok=True)
            if self.rank == root:
                xp.copyto(out, x)
        else:
            if xp is np and self.rank != root:
                self._writable(x, opname)
            out = x
        return ("Bcast", ([out, t], root), out, None)

    def _broadcast(self, x, root, out, inplace, xp):
        return self._run("broadcast", self._broadcast_op(x, root, out, inplace, xp, "broadcast"),
                         self._words("broadcast", x, None, root))

    def ibroadcast(self, x: Any, root: int = 0, out: Any = None, inplace: bool = False) -> Handle:
        """Non-blocking broadcast (MPI_Ibcast)."""
        if type(x) is not np.ndarray:
            return self._foreign("ibroadcast", x, root=root, out=out, inplace=inplace)
        return self._start("ibroadcast", self._broadcast_op(x, root, out, inplace, np, "ibroadcast"),
                           x, self._words("broadcast", x, None, root))

    def scatter(self, x: Any, root: int = 0, out: Any = None, inplace: bool = False) -> Any:
        """Split root's ``x`` along axis 0 into ``size`` equal parts; rank i gets part i.

        Every rank passes ``x`` of the full shape (non-root contents are ignored), or
        ``x=None`` with ``out``. In place, each rank's part lands in its own rows of
        ``x`` (root's stays where it is) and a view of those rows is returned.
        """
        if x is not None and type(x) is not np.ndarray:
            return self._foreign("scatter", x, root=root, out=out, inplace=inplace)
        if x is None and out is not None and type(out) is not np.ndarray:
            return self._foreign("scatter", x, root=root, out=out, inplace=inplace)
        return self._scatter(x, root, out, inplace, np)

    def _scatter(self, x, root, out, inplace, xp):
        is_root = self.rank == root
        if x is None:
            if is_root or out is None or inplace:
                raise self._err(ShapeError, "scatter", "x=None is allowed only on non-root "
                                "ranks that pass out")
            t = self._type(out, "scatter")
            if self.check:
                self._signature("scatter", out, None, root)
            if self._rec is not None:
                self._note("scatter", out, None, root)
            self._writable(out, "scatter", "out")
            return self._run("scatter", ("Scatter", (None, [out, t], root), out, None),
                             self._words("scatter", out, None, root))
        t = self._type(x, "scatter")
        rows = self._rows(x, "scatter")
        if self.check:
            self._signature("scatter", x, None, root)
        if self._rec is not None:
            self._note("scatter", x, None, root)
        part = x[self.rank * rows:(self.rank + 1) * rows]
        sig = self._words("scatter", x, None, root, x.size // self.size)
        if inplace:
            if xp is np and not is_root:
                self._writable(x, "scatter")
            args = ([x, t], IN_PLACE, root) if is_root else (None, [part, t], root)
            return self._run("scatter", ("Scatter", args, part, None), sig)
        # Only root reads x: elsewhere an out over x's memory overlaps nothing read.
        out = self._out(x, out, (rows,) + tuple(x.shape[1:]), "scatter", xp,
                        overlap_ok=not is_root)
        return self._run("scatter", ("Scatter", ([x, t] if is_root else None, [out, t], root), out,
                                     None), sig)

    def gather(self, x: Any, root: int = 0, out: Any = None, inplace: bool = False) -> Any:
        """Concatenate every rank's ``x`` along axis 0 on ``root`` (equal shapes).

        Returns the result on root, None elsewhere. In place, ``x`` is the full-size
        array on every rank, each rank's part already in its own rows.
        """
        if type(x) is not np.ndarray:
            return self._foreign("gather", x, root=root, out=out, inplace=inplace)
        return self._gather(x, root, out, inplace, np)

    def _gather(self, x, root, out, inplace, xp):
        t = self._type(x, "gather")
        if self.check:
            self._signature("gather", x, None, root)
        if self._rec is not None:
            self._note("gather", x, None, root)
        is_root = self.rank == root
        if inplace:
            rows = self._rows(x, "gather")
            sig = self._words("gather", x, None, root, x.size // self.size)
            if is_root:
                if xp is np:
                    self._writable(x, "gather")
                return self._run("gather", ("Gather", (IN_PLACE, [x, t], root), x, None), sig)
            part = x[self.rank * rows:(self.rank + 1) * rows]
            return self._run("gather", ("Gather", ([part, t], None, root), None, None), sig)
        sig = self._words("gather", x, None, root)
        if is_root:
            shape = (self.size * (x.shape[0] if x.ndim else 1),) + tuple(x.shape[1:])
            out = self._out(x, out, shape, "gather", xp)
            return self._run("gather", ("Gather", ([x, t], [out, t], root), out, None), sig)
        return self._run("gather", ("Gather", ([x, t], None, root), None, None), sig)

    def allgather(self, x: Any, out: Any = None, inplace: bool = False) -> Any:
        """Concatenate every rank's ``x`` (equal shapes) along axis 0, on every rank.

        In place, ``x`` is the full-size array with this rank's part in its rows.
        For per-rank lengths that differ, use ``allgatherv``.
        """
        if type(x) is not np.ndarray:
            return self._foreign("allgather", x, out=out, inplace=inplace)
        return self._allgather(x, out, inplace, np)

    def _allgather_op(self, x, out, inplace, xp, opname) -> "_Op":
        t = self._type(x, opname)
        if self.check:
            self._signature("allgather", x)
        if self._rec is not None:
            self._note("allgather", x)
        if inplace or out is x:
            self._rows(x, opname)
            if xp is np:
                self._writable(x, opname)
            return ("Allgather", (IN_PLACE, [x, t]), x, None)
        shape = (self.size * (x.shape[0] if x.ndim else 1),) + tuple(x.shape[1:])
        out = self._out(x, out, shape, opname, xp)
        return ("Allgather", ([x, t], [out, t]), out, None)

    def _allgather(self, x, out, inplace, xp):
        return self._run("allgather", self._allgather_op(x, out, inplace, xp, "allgather"),
                         self._words("allgather", x, count=self._part(x, inplace or out is x)))

    def _part(self, x, full: bool) -> int:
        """Elements one rank contributes: all of ``x``, or its share when ``x`` is the
        full-size in-place array."""
        return x.size // self.size if full else x.size

    def iallgather(self, x: Any, out: Any = None, inplace: bool = False) -> Handle:
        """Non-blocking allgather (MPI_Iallgather)."""
        if type(x) is not np.ndarray:
            return self._foreign("iallgather", x, out=out, inplace=inplace)
        return self._start("iallgather", self._allgather_op(x, out, inplace, np, "iallgather"), x,
                           self._words("allgather", x, count=self._part(x, inplace or out is x)))

    def _counts(self, x: np.ndarray, opname: str, root: int = -1,
                ) -> tuple[list[int], list[int], list[int]]:
        """Exchange per-rank row counts plus dtype/trailing shape and the call's signature
        (operation, root); raise on mismatch."""
        trailing = tuple(x.shape[1:])
        kind = "gatherv" if opname in ("gatherv", "igatherv") else "allgatherv"
        sig = np.array([x.shape[0] if x.ndim else 1, x.dtype.num * 1000 + x.dtype.itemsize,
                        hash(trailing) & 0x7FFFFFFFFFFF,
                        self._sig_meta(None, None, kind, root)], dtype=np.int64)
        table = np.empty((self.size, 4), dtype=np.int64)
        self.mpi.Allgather(sig, table)
        if (table[:, 3] != table[0, 3]).any():
            raise self._mismatch(opname, [[int(w), 0, 0] for w in table[:, 3]])
        bad = [k for k in range(self.size) if table[k, 1] != sig[1]]
        if bad:
            kinds = ", ".join(f"rank {k}: {self._describe('dtype', int(table[k, 1]))}"
                              for k in range(self.size))
            raise self._err(MismatchError, opname, f"dtypes differ across ranks ({kinds})")
        bad = [k for k in range(self.size) if table[k, 2] != table[0, 2]]
        if bad:
            raise self._err(MismatchError, opname,
                            f"trailing shapes differ across ranks (this rank: {trailing}; "
                            f"ranks {bad} differ from rank 0); only axis 0 may vary")
        rows = [int(v) for v in table[:, 0]]
        per_row = int(np.prod(trailing)) if trailing else 1
        counts = [r * per_row for r in rows]
        displs = [0] * self.size
        for k in range(1, self.size):
            displs[k] = displs[k - 1] + counts[k - 1]
        return rows, counts, displs

    def allgatherv(self, x: Any, out: Any = None) -> Any:
        """Concatenate every rank's ``x`` along axis 0 on every rank; lengths may differ.

        Always checks that dtype and trailing shape agree (raises MismatchError).
        """
        if type(x) is not np.ndarray:
            return self._foreign("allgatherv", x, out=out)
        return self._allgatherv(x, out, np)

    def _allgatherv(self, x, out, xp):
        t = self._type(x, "allgatherv")
        if self.check:
            self._signature("allgatherv", x)
        if self._rec is not None:
            self._note("allgatherv", x)
        rows, counts, displs = self._counts(x, "allgatherv")
        out = self._out(x, out, (sum(rows),) + tuple(x.shape[1:]), "allgatherv", xp)
        return self._run("allgatherv", ("Allgatherv", ([x, t], [out, (counts, displs), t]), out, None))

    def gatherv(self, x: Any, root: int = 0, out: Any = None) -> Any:
        """Like ``gather`` but per-rank lengths along axis 0 may differ."""
        if type(x) is not np.ndarray:
            return self._foreign("gatherv", x, root=root, out=out)
        return self._gatherv(x, root, out, np)

    def _gatherv(self, x, root, out, xp):
        t = self._type(x, "gatherv")
        if self.check:
            self._signature("gatherv", x, None, root)
        if self._rec is not None:
            self._note("gatherv", x, None, root)
        rows, counts, displs = self._counts(x, "gatherv", root)
        if self.rank != root:
            return self._run("gatherv", ("Gatherv", ([x, t], None, root), None, None))
        out = self._out(x, out, (sum(rows),) + tuple(x.shape[1:]), "gatherv", xp)
        return self._run("gatherv", ("Gatherv", ([x, t], [out, (counts, displs), t], root), out, None))

    def reduce_scatter(self, x: Any, op: str = SUM, out: Any = None,
                       inplace: bool = False) -> Any:
        """Reduce ``x`` over ranks and give rank i the i-th of ``size`` equal parts
        (along axis 0). In place, the result is the first part of ``x`` (a view)."""
        if type(x) is not np.ndarray:
            return self._foreign("reduce_scatter", x, op=op, out=out, inplace=inplace)
        return self._reduce_scatter(x, op, out, inplace, np)

    def _reduce_scatter_op(self, x, op, out, inplace, xp, opname) -> "_Op":
        t, mop, _, finish, canon, _ = self._redop(x, op, opname)
        self._type(x, opname)
        rows = self._rows(x, opname)
        if self.check:
            self._signature("reduce_scatter", x, canon)
        if self._rec is not None:
            self._note("reduce_scatter", x, canon)
        if inplace:
            if xp is np:
                self._writable(x, opname)
            return ("Reduce_scatter_block", (IN_PLACE, [x, t], mop), x[:rows],
                       self._finisher(finish, xp))
        out = self._out(x, out, (rows,) + tuple(x.shape[1:]), opname, xp)
        return ("Reduce_scatter_block", ([x, t], [out, t], mop), out, self._finisher(finish, xp))

    def _reduce_scatter(self, x, op, out, inplace, xp):
        return self._run("reduce_scatter",
                         self._reduce_scatter_op(x, op, out, inplace, xp, "reduce_scatter"),
                         self._words("reduce_scatter", x, op))

    def ireduce_scatter(self, x: Any, op: str = SUM, out: Any = None) -> Handle:
        """Non-blocking reduce_scatter (MPI_Ireduce_scatter_block)."""
        if type(x) is not np.ndarray:
            return self._foreign("ireduce_scatter", x, op=op, out=out)
        return self._start("ireduce_scatter",
                           self._reduce_scatter_op(x, op, out, False, np, "ireduce_scatter"), x,
                           self._words("reduce_scatter", x, op))

    def alltoall(self, x: Any, out: Any = None, inplace: bool = False) -> Any:
        """Rank i sends part j of ``x`` (axis 0 in ``size`` equal parts) to rank j and
        receives rank j's part i into part j of the result."""
        if type(x) is not np.ndarray:
            return self._foreign("alltoall", x, out=out, inplace=inplace)
        return self._alltoall(x, out, inplace, np)

    def _alltoall_op(self, x, out, inplace, xp, opname) -> "_Op":
        t = self._type(x, opname)
        self._rows(x, opname)
        if self.check:
            self._signature("alltoall", x)
        if self._rec is not None:
            self._note("alltoall", x)
        if inplace or out is x:
            if xp is np:
                self._writable(x, opname)
            return ("Alltoall", (IN_PLACE, [x, t]), x, None)
        out = self._out(x, out, x.shape, opname, xp)
        return ("Alltoall", ([x, t], [out, t]), out, None)

    def _alltoall(self, x, out, inplace, xp):
        return self._run("alltoall", self._alltoall_op(x, out, inplace, xp, "alltoall"),
                         self._words("alltoall", x))

    def ialltoall(self, x: Any, out: Any = None) -> Handle:
        """Non-blocking alltoall (MPI_Ialltoall)."""
        if type(x) is not np.ndarray:
            return self._foreign("ialltoall", x, out=out)
        return self._start("ialltoall", self._alltoall_op(x, out, False, np, "ialltoall"), x,
                           self._words("alltoall", x))

    # ---------------------------------------------------------------- fusion
    def grouped_allreduce(self, arrays: Sequence[Any], op: str = SUM,
                          fusion_threshold: int | None = None, _cache: bool = True) -> list[Any]:
        """Allreduce many arrays, packed into few buffers; results land in place.

        Arrays of the same dtype are copied, in order, into one fusion buffer of at
        most ``fusion_threshold`` bytes (default: env ``DTRUN_FUSION_THRESHOLD`` or
        64 MiB, as Horovod's HOROVOD_FUSION_THRESHOLD) and at most 4 MiB (so a buffer
        is packed straight into shared memory and stays in cache); each full buffer is
        reduced with one allreduce and copied back. An array of 1 MiB or more (or of
        the threshold, if smaller) is reduced on its own, in place: fusion saves
        per-call overhead, which such an array does not notice, and packing costs two
        copies. Returns ``arrays`` (same objects, updated). All ranks must pass the
        same list of shapes and dtypes.

        The split into buffers (and the MPI datatypes that pack/unpack them in C) is
        cached for the last 8 distinct lists of NumPy arrays, keyed by identity, as a
        training loop passes the same gradient arrays every step; the cache keeps those
        arrays alive until ``free()``. Tensors are never cached (their storage can move).
        """
        threshold = self.fusion_threshold if fusion_threshold is None else int(fusion_threshold)
        if not arrays:
            return list(arrays)
        # The cache is looked up by (length, first, last, threshold), then checked array by
        # array by identity: about 3x cheaper than hashing all the ids (256 arrays: 8 us).
        key = (len(arrays), id(arrays[0]), id(arrays[-1]), threshold)
        plan = self._group_plans.get(key)
        if plan is not None and not self._same_items(arrays, plan[1]):
            self._free_plan(self._group_plans.pop(key))
            plan = None
        if plan is None:
            if any(type(a) is not np.ndarray for a in arrays):
                return self._foreign("grouped_allreduce", list(arrays), op=op,
                                     fusion_threshold=threshold)
            plan = self._group_plan(arrays, threshold, key, op, cache=_cache)
        # The list's signature (every array's dtype and count, the op, the threshold) rides
        # in the first step's first exchange; once it matches, every rank has the same
        # plan, so the later steps carry none. Computed per call: the cached plan is
        # keyed by this rank's arrays only.
        words = plan[2] if (self._sig_on or self.check) and op == plan[3] else \
            (_sig.group_words(arrays, str(op), threshold) if self._sig_on or self.check else None)
        self._group_pending = arrays
        if self.check:
            self._full_words("grouped_allreduce", words)
        if self._rec is not None:
            self._note("grouped_allreduce", None)
        sig = words if self._sig_on else None
        if sig is not None and not plan[0]:  # nothing to reduce here: still compare
            self._light(sig, "grouped_allreduce")
        for step in plan[0]:
            if len(step) == 1:  # an array reduced on its own
                self._allreduce(step[0], op, None, True, np, sig)
                sig = None
                continue
            datatype, memory, dtype, count, pairs = step
            nbytes = count * dtype.itemsize
            shm = self._shm
            path = self._paths.pick(nbytes, True)[0] if shm is not None else "mpi"
            if path != "mpi" and self._engine_win is not None:
                # The compiled engine reduces the arrays where they are, as one stream
                # (no packing); False: a dtype or op it does not do (no rank synchronised).
                if self._engine.grouped(pairs, self._fusion_rep(dtype), op, sig):
                    sig = None
                    continue
            if path.startswith("shm") and nbytes <= SINGLE_STEP_MAX:
                # Pack straight into this rank's shared slot, unpack straight out of the
                # shared result: no intermediate fusion buffer at all.
                if sig is not None:
                    self._light(sig, "grouped_allreduce")
                    sig = None
                rep = self._fusion_rep(dtype)
                t, mop, kern, finish, _, _ = self._redop(rep, op, "grouped_allreduce")
                shm.allreduce_packed(
                    count, dtype, lambda v: datatype.Pack(memory, v, 0, MPI.COMM_SELF),
                    lambda v: datatype.Unpack(v, 0, memory, MPI.COMM_SELF), kern, t, mop,
                    finish, self._cross_ring if path == "shm+ring" else None)
                continue
            buf = self._fusion_bufs.get(dtype)
            if buf is None or buf.size < count:
                buf = self._fusion_bufs[dtype] = np.empty(max(count, 1024), dtype=dtype)
            flat = buf[:count]
            # Pack/unpack in C through an MPI datatype describing all the arrays: a
            # Python loop over 256 small arrays costs more than the allreduce itself.
            datatype.Pack(memory, flat, 0, MPI.COMM_SELF)
            self._allreduce(flat, op, None, True, np, sig)
            sig = None
            datatype.Unpack(flat, 0, memory, MPI.COMM_SELF)
        if not _cache:
            self._free_plan(plan)
        return list(arrays)

    def _fusion_rep(self, dtype: np.dtype) -> np.ndarray:
        """A small array of ``dtype`` (for op/dtype lookups keyed by an array)."""
        buf = self._fusion_bufs.get(dtype)
        if buf is None:
            buf = self._fusion_bufs[dtype] = np.empty(1024, dtype=dtype)
        return buf

    def _group_plan(self, arrays: Sequence[np.ndarray], threshold: int, key: tuple,
                    op: Any = SUM, cache: bool = True) -> tuple:
        """Validate ``arrays`` once and split them into fusion buffers.

        Returns (steps, arrays, signature words, op); a step is ``(array,)`` for an array
        reduced alone, or ``(datatype, memory, dtype, count)``: an hindexed MPI datatype
        covering a batch and a buffer spanning it. Cached by the identity of the arrays;
        the cache holds references to them, so an id cannot be reused by another object
        and the addresses stay valid (NumPy arrays never move their data). Read-only
        arrays are refused here, when the list is first seen (a cached list is not
        checked again: an array cannot become writable-then-read-only over ``bytes``).
        """
        groups: dict[np.dtype, list[np.ndarray]] = {}
        for i, a in enumerate(arrays):
            self._type(a, "grouped_allreduce")
            if not a.flags.writeable:
                raise self._err(ReadOnlyError, "grouped_allreduce",
                                f"array {i} (shape {a.shape}, {a.dtype}) is read-only (e.g. "
                                "np.frombuffer over bytes) and would receive the result in "
                                "place; pass a writable copy")
            groups.setdefault(a.dtype, []).append(a)
        steps: list[tuple] = []
        alone = min(threshold, FUSE_ALONE_BYTES)
        cap = min(threshold, SINGLE_STEP_MAX)
        for dtype in sorted(groups, key=lambda d: d.str):  # same order on every rank
            batch: list[np.ndarray] = []
            nbytes = 0
            for a in groups[dtype]:
                if a.nbytes >= alone:
                    steps.append((a,))
                    continue
                if nbytes + a.nbytes > cap:
                    steps.append(self._fused_step(batch, dtype))
                    batch, nbytes = [], 0
                batch.append(a)
                nbytes += a.nbytes
            if batch:
                steps.append(self._fused_step(batch, dtype))
        plan = (steps, list(arrays), _sig.group_words(arrays, str(op), threshold), op)
        if not cache:
            return plan
        if len(self._group_plans) >= 8:
            self._free_plan(self._group_plans.pop(next(iter(self._group_plans))))
        self._group_plans[key] = plan
        return plan

    @staticmethod
    def _fused_step(batch: list[np.ndarray], dtype: np.dtype) -> tuple:
        live = [a for a in batch if a.size]
        if len(live) <= 1:
            return (live[0],) if live else (batch[0],)
        addrs = [MPI.Get_address(a) for a in live]
        base = min(addrs)
        end = max(ad + a.nbytes for ad, a in zip(addrs, live))
        datatype = _dt.mpi_type(dtype).Create_hindexed(
            [a.size for a in live], [ad - base for ad in addrs]).Commit()
        if datatype.Get_extent()[1] != end - base:  # not expected; keep MPI honest
            datatype.Free()
            raise CollectiveError("grouped_allreduce", None, "internal: fused datatype "
                                  "extent differs from the arrays' span")
        count = sum(a.size for a in live)
        pairs = np.array([(ad, a.nbytes) for ad, a in zip(addrs, live)], dtype=np.int64)
        return (datatype, MPI.buffer.fromaddress(base, end - base), dtype, count, pairs)

    @staticmethod
    def _free_plan(plan: tuple) -> None:
        for step in plan[0]:
            if len(step) > 1:
                step[0].Free()


# A collective, set up (``_Op``): (mpi4py's blocking call, its arguments, the result,
# what completes the result in place once MPI is done, e.g. an average's division, or
# None). A plain tuple: building one sits on the allreduce hot path.
_Op = tuple


# mpi4py's non-blocking form of each blocking call that has one.
_NONBLOCKING = {"Allreduce": "Iallreduce", "Reduce": "Ireduce", "Bcast": "Ibcast",
                "Allgather": "Iallgather", "Reduce_scatter_block": "Ireduce_scatter_block",
                "Alltoall": "Ialltoall"}


class _MpiErrors:
    """``with comm._errors(op):`` turns an ``MPI.Exception`` into MPIError naming ``op``.

    A class rather than a generator-based context manager: it sits on the allreduce
    hot path, and ``Comm`` keeps one instance per operation name.
    """

    __slots__ = ("comm", "op")

    def __init__(self, comm: Comm, op: str) -> None:
        self.comm, self.op = comm, op

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None and issubclass(kind, MPI.Exception):
            raise self.comm._mpi_error(self.op, exc) from None
        return False


_WORLD: Comm | None = None


def world() -> Comm:
    """The communicator over all ranks (created on first use; collective then)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = Comm(MPI.COMM_WORLD)
    return _WORLD


def init() -> Comm:
    """Initialise MPI (mpi4py does on import) and return ``world()``."""
    return world()
