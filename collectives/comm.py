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
  the first exchange every path makes (signature.py, sigcheck.py): beside the counter of the
  compiled engine's first synchronisation on one host (free for the shm1/shm2 paths;
  one shared-memory synchronisation before any other path, so a rank on another path
  meets it), else one 48-byte MPI allreduce before the call. Ranks that disagree all
  raise ``MismatchError`` naming what each passed, before any data moves. Non-blocking
  calls compare through an ``Iallgather`` checked at ``wait()``: a non-blocking call
  against a blocking one is not detected (MPI forbids the pairing).
* with ``DTRUN_CHECK=1`` (or ``Comm(check=True)``): before each collective the
  ranks also allgather (operation, dtype, element count, op, root) and every rank raises
  ``MismatchError`` naming the ranks that disagree (a whole extra collective per call).

The parts of a communicator live beside it: ``topology`` (hosts and local ranks),
``transport`` (shared memory, rings, the compiled engine, the path per size),
``fusion`` (grouped_allreduce's plans), ``sigcheck`` (the signature exchange) and
``recorder`` (the flight recorder).
"""

from __future__ import annotations

import operator
import os
from typing import Any, Sequence

import numpy as np

from . import dtypes as _dt
from . import fusion as _fusion
from . import recorder as _rec
from . import signature as _sig
from . import sigcheck as _sc
from . import topology as _topology
from . import transport as _transport
from . import tuning as _tuning
from ._mpi import MPI
from .errors import (CollectiveError, MismatchError, MPIError, NotContiguousError,
                     OverlapError, ReadOnlyError, ShapeError, UnsupportedDtypeError)
from .handle import Handle
from . import shm1 as _shm1
from .sizes import env_bytes

SUM, PROD, MIN, MAX, AVG = _dt.SUM, _dt.PROD, _dt.MIN, _dt.MAX, _dt.AVG
IN_PLACE = MPI.IN_PLACE
ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG

# Module globals for the allreduce hot path (one dict lookup each).
_INSIDE, _PATH_BITS = _rec.INSIDE_WORD, _transport.PATH_BITS
_REC_COUNT_MAX = (1 << _rec.COUNT_BITS) - 1


def _same_items(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether ``a`` and ``b`` hold the same objects, in order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_off(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("0", "false", "no", "off")


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
        self.mpi = comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        topo = self.topology = _topology.discover(comm, node_comm)
        self.rank, self.size, self.host = topo.rank, topo.size, topo.host
        self.local_rank, self.local_size = topo.local_rank, topo.local_size
        self.node, self.nnodes = topo.node, topo.nnodes
        self._node_comm, self._uniform_nodes = topo.node_comm, topo.uniform
        self._check = _env_flag("DTRUN_CHECK") if check is None else bool(check)
        self._sig_on = (not _env_off("DTRUN_CHECK")) if signatures is None else bool(signatures)
        self._sigs = _sc.Exchange(comm, self.rank, self.size, self.local_rank)
        self.fusion_threshold = env_bytes("DTRUN_FUSION_THRESHOLD",
                                          _fusion.DEFAULT_FUSION_THRESHOLD)
        use_shm = (os.environ.get("DTRUN_SHM", "1").strip() != "0") if shm is None else shm
        _transport.open_transports(self, use_shm)
        # The compiled engine: its allreduce() falls back to this class's for what it
        # does not take.
        _transport.open_engine(self, Comm.allreduce.__get__(self))
        # grouped_allreduce's plan check: the same arrays, in order (compiled: ~25x faster)
        self._plans = _fusion.Plans(_shm1.same_items if _shm1.available() else _same_items)
        self._opcache: dict[tuple[np.dtype, str], tuple] = {}
        self._gpu = None  # collectives.gpu.GpuContext, created on first GPU array
        self._error_ctx: dict[str, _MpiErrors] = {}
        # The recorder first: the path table's calibration records its progress there.
        self._open_recorder(comm == MPI.COMM_WORLD)
        self._paths = _transport.select_paths(self, use_shm, shm_threshold, shm_chunk, path)
        _transport.restart_recorder(self)
        if self._engine_win is not None:
            _transport.fast_limits(self)
            # The instance's allreduce is the engine's: NumPy calls it takes run in C with
            # no Python frame; the rest go to Comm.allreduce.
            self.allreduce = self._engine.allreduce

    def _open_recorder(self, world: bool) -> None:
        """The flight recorder, when this is the process's first Comm over COMM_WORLD
        under dtrun: ``_rec`` its ring, ``_hdr`` its header (word INSIDE_WORD is 1 while
        inside a blocking collective), ``_rec_store`` the store to call."""
        self._rec = self._rec_map = self._hdr = self._rec_store = self._py_rec_store = None
        self._recorder: _rec.Recorder | None = None
        rec = _rec.OWNER.claim(self.rank) if world else None
        if rec is not None:
            self._rec_map, self._rec, self._hdr = rec.map, rec.ring, rec.header
            self._recorder, self._py_rec_store = rec, rec.store
            self._rec_store = _transport.attach_recorder(self._engine, rec)

    @property
    def check(self) -> bool:
        """DTRUN_CHECK mode: ranks compare each collective's signature first."""
        return self._check

    @check.setter
    def check(self, value: bool) -> None:
        self._check = bool(value)
        _transport.fast_limits(self)

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

    def _calibration_run(self, cand: tuple[str, int], src: np.ndarray, dst: np.ndarray,
                         inplace: bool) -> None:
        """One float32 sum allreduce along candidate path ``cand`` (transport.py)."""
        _transport.calibration_run(self, cand, src, dst, inplace)

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

    def _note(self, opname: str, x: np.ndarray | None, redop: str | None = None,
              root: int = -1) -> None:
        """Flight recorder: this rank starts collective ``opname`` (collectives/recorder.py)."""
        desc = _rec.OP_BITS.get(opname, 0) | _rec.root_bits(root)
        if x is not None:
            desc |= _rec.dtype_bits(_dt.dtype_name(x.dtype)) | min(x.size, _REC_COUNT_MAX)
        self._rec_store(desc)

    def _begin(self, x: np.ndarray, opname: str, kind: str, canon: str | None = None,
               root: int = -1) -> MPI.Datatype:
        """What every collective but allreduce's inlined path does first: validate ``x``
        (returns its MPI datatype), DTRUN_CHECK's exchange, the recorder's entry."""
        t = self._type(x, opname)
        if self.check:
            self._sigs.full(kind, x, canon, root)
        if self._rec is not None:
            self._note(kind, x, canon, root)
        return t

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
        self._plans.clear()
        if self._shm is not None:
            self._shm.free()
            self._shm = None
        if self._engine_win is not None:
            self.__dict__.pop("allreduce", None)  # back to Comm.allreduce (breaks the cycle)
            self._engine.set_fast((), ())  # a bound method kept from before falls back too
            _shm1.free(self._engine_win)
            self._engine_win = self._sigs.engine = None
            if self._rec_store != self._engine.note:  # else it still writes the recorder
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
                self._sigs.light(sig, opname)
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
                sig_req, table, mine = self._sigs.start(sig)
            request = getattr(self.mpi, _NONBLOCKING[call])(*args)
        if checked:
            request = _sc.Checked(self._sigs, sig_req, table, request, opname)
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
            self._sigs.full("barrier", None)
        if self._rec is not None:
            self._note("barrier", None)
        h = self._hdr
        if h is not None:
            h[_INSIDE] = 1
        try:
            if self._sig_on:
                self._sigs.light((_sig.meta("barrier"), 0, 0), "barrier")
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

    def allreduce(self, x: Any, op: str = SUM, out: Any = None, inplace: bool = False,
                  _xp: Any = np, _sig: Any = True) -> Any:
        """Reduce ``x`` over all ranks with ``op`` (sum, prod, min, max, avg); every rank
        gets the result. Returns a new array, or ``out``, or ``x`` when ``inplace``.

        The one blocking allreduce (also ``_allreduce``): ``_xp`` is the module of ``x``
        (cupy, for a CUDA-aware MPI); ``_sig`` the signature its first exchange carries:
        True, its own; None, none (grouped_allreduce steps after the first); or words."""
        if type(x) is not np.ndarray and _xp is np:
            return self._foreign("allreduce", x, op=op, out=out, inplace=inplace)
        # One Python frame for the NumPy case: at 8 bytes each call level costs about
        # 5 % of an MPI_Allreduce.
        try:
            t, mop, kern, finish, canon, rbits = self._opcache[(x.dtype, op)]
        except (KeyError, TypeError):
            t, mop, kern, finish, canon, rbits = self._redop(x, op, "allreduce")
        if not x.flags.c_contiguous:
            self._type(x, "allreduce")
        if self.check:
            self._sigs.full("allreduce", x, canon)
        if self._rec is not None:  # flight recorder
            self._rec_store(rbits | min(x.size, _REC_COUNT_MAX))
        if inplace or out is x:
            if _xp is np and not x.flags.writeable:
                self._writable(x, "allreduce")
            out, send = x, IN_PLACE
        elif out is None and _xp is np:
            out, send = np.empty(x.shape, x.dtype), [x, t]
        else:
            out, send = self._given_out(x, out, _xp), [x, t]
        h = self._hdr  # the recorder's flag: this rank is inside a collective (waiting, mostly)
        if h is not None:
            h[_INSIDE] = 1
        try:
            if x.nbytes >= self._paths.floor and _xp is np:  # small messages: this one comparison
                path, chunk = self._paths.pick(x.nbytes, send is IN_PLACE)
                if path != "mpi":
                    if _sig is True:
                        _sig = (self._sigs.meta(x.dtype, canon) | _PATH_BITS[path], x.size, 0) \
                            if self._sig_on else None
                    with self._errors("allreduce"):
                        _transport.via(self, path, chunk, x, out, send is IN_PLACE, t, mop, kern,
                                       finish, canon, _sig)
                    return out
            if _sig is True:
                _sig = (self._sigs.meta(x.dtype, canon) | _PATH_BITS["mpi"], x.size, 0) \
                    if self._sig_on else None
            if _sig is not None:
                self._sigs.light(_sig, "allreduce")
            try:
                self.mpi.Allreduce(send, [out, t], mop)
            except MPI.Exception as e:  # the one translation (hot path: no `with`)
                raise self._mpi_error("allreduce", e) from None
        finally:
            if h is not None:
                h[_INSIDE] = 0
        if finish is not None:
            (finish if _xp is np else self._finisher(finish, _xp))(out)
        return out

    _allreduce = allreduce

    def _given_out(self, x: Any, out: Any, xp: Any) -> Any:
        """The ``out`` passed to allreduce, checked (one call level for a valid NumPy
        one: it sits on the hot path); raises, or returns it."""
        if xp is np and type(out) is np.ndarray and out.dtype == x.dtype and \
                out.shape == x.shape and out.flags.c_contiguous:
            if not out.flags.writeable:
                self._writable(out, "allreduce", "out")
            if out is not x and np.may_share_memory(x, out):
                self._no_overlap(x, out, "allreduce")
            return out
        return self._out(x, out, x.shape, "allreduce", xp)  # raises, or a valid foreign out

    def _dest(self, x: Any, out: Any, inplace: bool, xp: Any, opname: str, t) -> tuple:
        """(result array, send argument) of a reduction that writes ``x``'s shape: ``x``
        itself in place, else ``out`` checked or allocated."""
        if inplace or out is x:
            if xp is np:
                self._writable(x, opname)
            return x, IN_PLACE
        return self._out(x, out, x.shape, opname, xp), [x, t]

    def iallreduce(self, x: Any, op: str = SUM, out: Any = None, inplace: bool = False) -> Handle:
        """Non-blocking allreduce (MPI_Iallreduce); ``wait()`` returns the result."""
        if type(x) is not np.ndarray:
            return self._foreign("iallreduce", x, op=op, out=out, inplace=inplace)
        return self._iallreduce(x, op, out, inplace, np)

    def _iallreduce(self, x, op, out, inplace, xp):
        t, mop, _, finish, canon, _ = self._redop(x, op, "iallreduce")
        self._begin(x, "iallreduce", "allreduce", canon)
        out, send = self._dest(x, out, inplace, xp, "iallreduce", t)
        return self._start("iallreduce", ("Allreduce", (send, [out, t], mop), out,
                                          self._finisher(finish, xp)),
                           x, self._words("allreduce", x, op))

    def _words(self, kind: str, x: Any, op: str | None = None, root: int = -1,
               count: int | None = None) -> tuple | None:
        """The signature words of collective ``kind`` on ``x`` (None when checks are off)."""
        if not self._sig_on:
            return None
        canon = _dt.OP_ALIASES.get(str(op).lower()) if op is not None else None
        dtype = None if x is None else x.dtype
        return (self._sigs.meta(dtype, canon, kind, root),
                (0 if x is None else x.size) if count is None else count, 0)

    def reduce(self, x: Any, op: str = SUM, root: int = 0, out: Any = None,
               inplace: bool = False) -> Any:
        """Reduce ``x`` onto ``root``; returns the result on root, None elsewhere."""
        if type(x) is not np.ndarray:
            return self._foreign("reduce", x, op=op, root=root, out=out, inplace=inplace)
        return self._reduce(x, op, root, out, inplace, np)

    def _reduce_op(self, x, op, root, out, inplace, xp, opname) -> "_Op":
        t, mop, _, finish, canon, _ = self._redop(x, op, opname)
        self._begin(x, opname, "reduce", canon, root)
        if self.rank != root:
            return ("Reduce", ([x, t], None, mop, root), None, None)
        out, send = self._dest(x, out, inplace, xp, opname, t)
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
        t = self._begin(x, opname, "broadcast", None, root)
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
            t = self._begin(out, "scatter", "scatter", None, root)
            self._writable(out, "scatter", "out")
            return self._run("scatter", ("Scatter", (None, [out, t], root), out, None),
                             self._words("scatter", out, None, root))
        t = self._type(x, "scatter")
        rows = self._rows(x, "scatter")
        if self.check:
            self._sigs.full("scatter", x, None, root)
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
        t = self._begin(x, "gather", "gather", None, root)
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
        t = self._begin(x, opname, "allgather")
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
                        self._sigs.meta(None, None, kind, root)], dtype=np.int64)
        table = np.empty((self.size, 4), dtype=np.int64)
        self.mpi.Allgather(sig, table)
        if (table[:, 3] != table[0, 3]).any():
            raise self._sigs.mismatch(opname, [[int(w), 0, 0] for w in table[:, 3]])
        bad = [k for k in range(self.size) if table[k, 1] != sig[1]]
        if bad:
            kinds = ", ".join(f"rank {k}: {_sc.describe('dtype', int(table[k, 1]))}"
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
        t = self._begin(x, "allgatherv", "allgatherv")
        rows, counts, displs = self._counts(x, "allgatherv")
        out = self._out(x, out, (sum(rows),) + tuple(x.shape[1:]), "allgatherv", xp)
        return self._run("allgatherv", ("Allgatherv", ([x, t], [out, (counts, displs), t]), out, None))

    def gatherv(self, x: Any, root: int = 0, out: Any = None) -> Any:
        """Like ``gather`` but per-rank lengths along axis 0 may differ."""
        if type(x) is not np.ndarray:
            return self._foreign("gatherv", x, root=root, out=out)
        return self._gatherv(x, root, out, np)

    def _gatherv(self, x, root, out, xp):
        t = self._begin(x, "gatherv", "gatherv", None, root)
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
            self._sigs.full("reduce_scatter", x, canon)
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
            self._sigs.full("alltoall", x)
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
        key, plan = self._plans.lookup(arrays, threshold)
        if plan is None:
            if any(type(a) is not np.ndarray for a in arrays):
                return self._foreign("grouped_allreduce", list(arrays), op=op,
                                     fusion_threshold=threshold)
            plan = self._plans.build(arrays, threshold, key, op, self._type, self.rank,
                                     cache=_cache)
        # The list's signature (every array's dtype and count, the op, the threshold):
        # computed per call unless the plan's op is this one, as the cached plan is keyed
        # by this rank's arrays only.
        words = None
        if self._sig_on or self.check:
            words = plan.words if op == plan.op else _sig.group_words(arrays, str(op), threshold)
        self._sigs.pending = arrays
        if self.check:
            self._sigs.full_words("grouped_allreduce", words)
        if self._rec is not None:
            self._note("grouped_allreduce", None)
        _fusion.run(self, plan, op, words if self._sig_on else None)
        if not _cache:
            plan.free()
        return list(arrays)


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
