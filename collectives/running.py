"""Running a collective once it is set up: blocking, non-blocking, and what both do first.

Each collective with a non-blocking twin is described once as an ``Op`` (mpi4py's
blocking call, its arguments, the result, what completes the result); ``Running._run``
runs it blocking, ``Running._start`` as MPI_I... behind a ``Handle``. Around the call:
the flight recorder's entry and its "inside a collective" flag, the signature words
compared in the first exchange, and the one translation of ``MPI.Exception`` into
``MPIError``. Arrays that are not NumPy's go to ``arrays.dispatch``. ``Comm`` inherits
it; the blocking allreduce inlines the same steps (its hot path).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import arrays
from . import dtypes as _dt
from . import recorder as _rec
from . import sigcheck as _sc
from ._mpi import MPI
from .handle import Handle

# A collective, set up (``Op``): (mpi4py's blocking call, its arguments, the result,
# what completes the result in place once MPI is done, e.g. an average's division, or
# None). A plain tuple: building one sits on the allreduce hot path.
Op = tuple

# mpi4py's non-blocking form of each blocking call that has one.
NONBLOCKING = {"Allreduce": "Iallreduce", "Reduce": "Ireduce", "Bcast": "Ibcast",
               "Allgather": "Iallgather", "Reduce_scatter_block": "Ireduce_scatter_block",
               "Alltoall": "Ialltoall"}

# Module globals for the hot path (one dict lookup each).
_INSIDE = _rec.INSIDE_WORD
_REC_COUNT_MAX = (1 << _rec.COUNT_BITS) - 1


class MpiErrors:
    """``with comm._errors(op):`` turns an ``MPI.Exception`` into MPIError naming ``op``.

    A class rather than a generator-based context manager: it sits on the allreduce
    hot path, and ``Comm`` keeps one instance per operation name.
    """

    __slots__ = ("comm", "op")

    def __init__(self, comm: Any, op: str) -> None:
        self.comm, self.op = comm, op

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None and issubclass(kind, MPI.Exception):
            raise self.comm._mpi_error(self.op, exc) from None
        return False


class Running:
    """How ``Comm`` runs a set-up collective (a mixin: it reads ``rank``, ``size``,
    ``mpi``, ``check``, ``_sigs``, ``_sig_on``, ``_rec``, ``_rec_store``, ``_hdr`` and
    ``_error_ctx``, which ``Comm.__init__`` sets)."""

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

    def _words(self, kind: str, x: Any, op: str | None = None, root: int = -1,
               count: int | None = None) -> tuple | None:
        """The signature words of collective ``kind`` on ``x`` (None when checks are off)."""
        if not self._sig_on:
            return None
        canon = _dt.OP_ALIASES.get(str(op).lower()) if op is not None else None
        dtype = None if x is None else x.dtype
        return (self._sigs.meta(dtype, canon, kind, root),
                (0 if x is None else x.size) if count is None else count, 0)

    def _foreign(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Operations on non-NumPy arrays: torch CPU tensors, GPU arrays."""
        return arrays.dispatch(self, name, args, kwargs)

    def _errors(self, op: str) -> "MpiErrors":
        """Context manager: an ``MPI.Exception`` inside becomes MPIError naming ``op``."""
        ctx = self._error_ctx.get(op)
        if ctx is None:
            ctx = self._error_ctx[op] = MpiErrors(self, op)
        return ctx

    def _finisher(self, finish, xp):
        """What completes a reduction's result in place (an average's division), for ``xp``."""
        if finish is None or xp is np:
            return finish
        n = self.size
        return lambda r: xp.true_divide(r, n, out=r)

    def _run(self, opname: str, c: "Op", sig: tuple | None = None) -> Any:
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

    def _start(self, opname: str, c: "Op", keep: Any, sig: tuple | None = None) -> Handle:
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
            request = getattr(self.mpi, NONBLOCKING[call])(*args)
        if checked:
            request = _sc.Checked(self._sigs, sig_req, table, request, opname)
            keep = (keep, mine)
        return Handle(request, result, post, keep=keep, op=opname)
