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
``fusion`` (grouped_allreduce's plans), ``sigcheck`` (the signature exchange),
``recorder`` (the flight recorder). ``Comm`` itself holds what it is made of, the
blocking allreduce (the hot path), barrier and grouped_allreduce; it inherits the rest:
``arguments`` (the local checks of a call's arguments), ``running`` (how a set-up
collective runs, blocking or not), ``operations`` (the other collectives and the
non-blocking ones) and ``point_to_point`` (send and receive).
"""

from __future__ import annotations

import operator
import os
from typing import Any, Sequence

import numpy as np

from . import dtypes as _dt
from . import fusion as _fusion
from . import recorder as _rec
from . import shm1 as _shm1
from . import signature as _sig
from . import sigcheck as _sc
from . import topology as _topology
from . import transport as _transport
from . import tuning as _tuning
from ._mpi import MPI
from .arguments import IN_PLACE, Arguments
from .operations import Operations
from .point_to_point import ANY_SOURCE, ANY_TAG, PointToPoint  # noqa: F401 (public here)
from .running import MpiErrors, Running
from .sizes import env_bytes

SUM, PROD, MIN, MAX, AVG = _dt.SUM, _dt.PROD, _dt.MIN, _dt.MAX, _dt.AVG

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


class Comm(Arguments, Running, Operations, PointToPoint):
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
        path: take this allreduce path at every size ("mpi", "shm1", "shm2", "shm",
            "shm+hierarchical", "shm+ring", "ring", "stream"; default: env
            ``DTRUN_ALLREDUCE_PATH``, else measured).
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
        self._error_ctx: dict[str, MpiErrors] = {}
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

    def __repr__(self) -> str:
        return (f"<collectives.Comm rank {self.rank}/{self.size} local {self.local_rank}/"
                f"{self.local_size} node {self.node}/{self.nnodes} host {self.host}>")

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
        them), "shm+ring" (shared memory within hosts, a ring between them), "ring"
        (a ring over all ranks) or "stream" (shared memory within hosts, a streaming TCP
        ring between them). The same on every rank."""
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
        _transport.close_stream(self)
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

    # ---------------------------------------------------------------- collectives
    # The others, and their non-blocking twins, are in operations.py.
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
