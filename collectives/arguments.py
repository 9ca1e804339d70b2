"""Checking a collective's arguments on this rank, before anything moves.

The local half of the module doc of ``comm``: an unsupported dtype, a non-contiguous or
read-only array, an ``out`` of the wrong shape or overlapping ``x``, lengths the ranks
cannot split, a reduction op that makes no sense for the dtype. Each check raises the
collective's error naming the operation and the rank. Separate from ``comm`` because
every collective uses it and none of it talks to another rank; ``Comm`` inherits it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import dtypes as _dt
from . import recorder as _rec
from ._mpi import MPI
from .errors import (CollectiveError, MPIError, NotContiguousError, OverlapError, ReadOnlyError,
                     ShapeError, UnsupportedDtypeError)

IN_PLACE = MPI.IN_PLACE


class Arguments:
    """The argument checks of ``Comm`` (a mixin: it reads ``rank``, ``size`` and
    ``_opcache``, which ``Comm.__init__`` sets)."""

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
                 _dt.divider(x.dtype, self.size) if canon == _dt.AVG else None, canon,
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

    def _part(self, x, full: bool) -> int:
        """Elements one rank contributes: all of ``x``, or its share when ``x`` is the
        full-size in-place array."""
        return x.size // self.size if full else x.size
