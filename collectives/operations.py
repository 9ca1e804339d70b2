"""The collectives besides the blocking allreduce, barrier and grouped_allreduce.

reduce, broadcast, scatter, gather, allgather, allgatherv, gatherv, reduce_scatter and
alltoall, and the non-blocking twins (iallreduce, ireduce, ibroadcast, iallgather,
ireduce_scatter, ialltoall). Each collective with a non-blocking twin sets up once, in
``_<name>_op``: the checks, the DTRUN_CHECK signature, the output array and the MPI
arguments; the blocking form runs that description with ``_run``, the ``i...`` form
with ``_start`` (``running``). The ``_<name>(..., xp)`` forms take the array module of
``x`` (cupy, for a CUDA-aware MPI). ``Comm`` inherits them; the allreduce hot path
stays in ``comm``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import sigcheck as _sc
from .dtypes import SUM
from .errors import MismatchError, ShapeError
from .handle import Handle
from .arguments import IN_PLACE
from .running import Op


class Operations:
    """The collectives of ``Comm`` built on ``Running`` and ``Arguments`` (a mixin)."""

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

    def reduce(self, x: Any, op: str = SUM, root: int = 0, out: Any = None,
               inplace: bool = False) -> Any:
        """Reduce ``x`` onto ``root``; returns the result on root, None elsewhere."""
        if type(x) is not np.ndarray:
            return self._foreign("reduce", x, op=op, root=root, out=out, inplace=inplace)
        return self._reduce(x, op, root, out, inplace, np)

    def _reduce_op(self, x, op, root, out, inplace, xp, opname) -> "Op":
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

    def _broadcast_op(self, x, root, out, inplace, xp, opname) -> "Op":
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

    def _allgather_op(self, x, out, inplace, xp, opname) -> "Op":
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

    def _reduce_scatter_op(self, x, op, out, inplace, xp, opname) -> "Op":
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

    def _alltoall_op(self, x, out, inplace, xp, opname) -> "Op":
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
