"""The signature exchange: ranks compare what they are about to call before data moves.

``signature.py`` defines the three words; this module carries them between ranks and
turns a difference into ``MismatchError`` on every rank. Three carriers:

* ``light``: the check a path without its own carrier makes first: one synchronisation
  of the compiled engine on one host (a rank whose call took the engine meets it
  there), else a 48-byte MAX allreduce of the words and their negations (all equal iff
  max == -max of the negations);
* ``start`` + ``Checked``: non-blocking calls, through an ``Iallgather`` checked at
  ``wait()``;
* ``full`` / ``full_words``: ``DTRUN_CHECK=1``, a whole allgather of the fields before
  each collective.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import dtypes as _dt
from . import signature as _sig
from ._mpi import MPI
from .errors import MismatchError

OP_CODES = {name: i for i, name in enumerate(
    ["allreduce", "reduce", "broadcast", "scatter", "gather", "allgather", "gatherv",
     "allgatherv", "reduce_scatter", "alltoall", "barrier", "grouped_allreduce"])}
REDOP_CODES = {None: 0, _dt.SUM: 1, _dt.PROD: 2, _dt.MIN: 3, _dt.MAX: 4, _dt.AVG: 5}
_FIELDS = ("operation", "dtype", "element count", "reduction op", "root")


def describe(field: str, value: int) -> str:
    """One field of a DTRUN_CHECK row, readable: an operation or dtype name, an op."""
    if field == "operation":
        return next((k for k, v in OP_CODES.items() if v == value), str(value))
    if field == "dtype" and value >= 0:
        num, size = divmod(value, 1000)
        for d in _dt._MPI_TYPE:
            if d.num == num and d.itemsize == size:
                return _dt.dtype_name(d)
    if field == "reduction op":
        return next((str(k) for k, v in REDOP_CODES.items() if v == value), str(value))
    return str(value)


class Exchange:
    """One communicator's signature exchange: its buffers, the cache of ``w0`` words,
    and the grouped_allreduce list in flight (for the message naming the first array
    that differs). ``engine`` is the compiled engine while it holds the host's shared
    memory (``Comm`` sets and clears it)."""

    __slots__ = ("mpi", "rank", "size", "local_rank", "engine", "buf", "base", "pending")

    def __init__(self, mpi: MPI.Intracomm, rank: int, size: int, local_rank: int) -> None:
        self.mpi, self.rank, self.size, self.local_rank = mpi, rank, size, local_rank
        self.engine = None
        self.buf = np.zeros(6, dtype=np.int64)  # [w0, w1, w2, -w0, -w1, -w2]
        self.base: dict[tuple, int] = {}
        self.pending: Sequence[Any] | None = None

    def meta(self, dtype: np.dtype | None, canon: str | None, kind: str = "allreduce",
             root: int = -1) -> int:
        """``w0`` of a signature (signature.py); cached per (kind, dtype, op, root)."""
        key = (kind, dtype, canon, root)
        w = self.base.get(key)
        if w is None:
            w = self.base[key] = _sig.meta(kind, None if dtype is None else
                                           _dt.dtype_name(dtype), canon, None, root)
        return w

    def light(self, words: tuple, opname: str) -> None:
        """Compare ``words`` across ranks (see the module doc); raise on a difference."""
        if self.engine is not None:
            self.engine.check(words)
            return
        if self.size == 1:
            return
        w0, w1, w2 = words
        buf = self.buf
        buf[:] = (w0, w1, w2, -w0, -w1, -w2)
        self.mpi.Allreduce(MPI.IN_PLACE, buf, MPI.MAX)
        if buf[0] != -buf[3] or buf[1] != -buf[4] or buf[2] != -buf[5]:
            raise self.mismatch(opname, self._gather(words).tolist())

    def _gather(self, words: tuple) -> np.ndarray:
        table = np.empty((self.size, 3), dtype=np.int64)
        self.mpi.Allgather(np.array(words, dtype=np.int64), table)
        return table

    def start(self, words: tuple) -> tuple:
        """The non-blocking form: (request, table, own words) of an Iallgather."""
        mine = np.array(words, dtype=np.int64)
        table = np.empty((self.size, 3), dtype=np.int64)
        return self.mpi.Iallgather(mine, table), table, mine

    def full_words(self, opname: str, words: tuple) -> None:
        """DTRUN_CHECK mode for a signature in words (grouped_allreduce): allgather every
        rank's and raise MismatchError on every rank when any differs."""
        table = self._gather(words)
        if (table != table[0]).any():
            raise self.mismatch(opname, table.tolist())

    def full(self, opname: str, x: np.ndarray | None, redop: str | None = None,
             root: int = -1) -> None:
        """DTRUN_CHECK mode: all ranks compare what they are about to call."""
        sig = np.array([
            OP_CODES.get(opname, 99),
            -1 if x is None else x.dtype.num * 1000 + x.dtype.itemsize,
            -1 if x is None else x.size,
            REDOP_CODES.get(_dt.OP_ALIASES.get(str(redop).lower()) if redop else None, 9),
            root,
        ], dtype=np.int64)
        table = np.empty((self.size, sig.size), dtype=np.int64)
        self.mpi.Allgather(sig, table)
        diffs = _differences(table, opname, x is None)
        if diffs:
            raise MismatchError(opname, self.rank, "; ".join(diffs) + " — " +
                                _sig.explain(_rows_as_words(table, x is None)))

    def engine_mismatch(self, rows: list) -> None:
        """The engine's callback when the ranks' signatures differ (one host: local ranks
        are the communicator's ranks): raise MismatchError on this rank."""
        kind = _sig.KINDS[(rows[self.local_rank][0] >> _sig.KIND_SHIFT) & 31] or "collective"
        raise self.mismatch(kind, rows)

    def mismatch(self, opname: str, rows: list) -> MismatchError:
        """MismatchError naming every rank's signature (``rows[rank]``); for lists of
        grouped_allreduce arrays also the first array that differs (one more exchange,
        which every rank makes: they all see the same rows)."""
        text = ("ranks called with different arguments: " + _sig.explain(rows) +
                "; every rank must make the same collective calls, in the same order, with "
                "the same dtypes, element counts, ops and roots")
        kinds = {(int(r[0]) >> _sig.KIND_SHIFT) & 31 for r in rows}
        if kinds == {_sig.KINDS.index("grouped_allreduce")}:
            text += self._first_group_difference()
        return MismatchError(opname, self.rank, text)

    def _first_group_difference(self) -> str:
        """Where the ranks' grouped_allreduce lists first differ (collective)."""
        arrays = self.pending or []
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
                return (f"; first difference at array {i}: " +
                        ", ".join(f"rank {k}: {_show_cell(c)}" for k, c in enumerate(cells)))
        return ("; the arrays agree in dtype and count: the op or fusion_threshold "
                "differs")


def _show_cell(c: tuple | None) -> str:
    if c is None:
        return "no such array"
    return f"{c[1]} x {_sig._DTYPES[c[0]] if c[0] < len(_sig._DTYPES) else '?'}"


def _differences(table: np.ndarray, opname: str, no_array: bool) -> list[str]:
    """"<field> differs (rank 0: …, rank 1: …)" for each field of a DTRUN_CHECK table
    the ranks disagree on (counts may differ in the v-variants)."""
    diffs = []
    for i, name in enumerate(_FIELDS):
        col = table[:, i]
        if (col != col[0]).any():
            if name == "element count" and opname in ("gatherv", "allgatherv"):
                continue
            if no_array and name in ("dtype", "element count"):
                continue
            detail = ", ".join(f"rank {k}: {describe(name, int(v))}" for k, v in enumerate(col))
            diffs.append(f"{name} differs ({detail})")
    return diffs


def _rows_as_words(table: np.ndarray, no_array: bool) -> list[tuple]:
    """A DTRUN_CHECK table as signature words, for ``signature.explain``."""
    rows = []
    for k in range(len(table)):
        kind, dtype, _, redop, _ = (describe(f, int(v)) for f, v in zip(_FIELDS, table[k]))
        rows.append((_sig.meta(kind if kind in _sig.KINDS else "allreduce",
                               None if no_array else dtype,
                               redop if redop in _sig.REDOPS else None, None,
                               int(table[k, 4])), int(table[k, 2]), 0))
    return rows


class Checked:
    """A non-blocking collective whose signature exchange (an ``Iallgather`` started just
    before it) is checked before its own completion is waited for: a mismatch raises on
    every rank's ``wait()``/``test()`` instead of waiting for data that never matches."""

    __slots__ = ("exchange", "sig_req", "table", "data", "op", "checked")

    def __init__(self, exchange: Exchange, sig_req, table, data, op: str) -> None:
        self.exchange, self.sig_req, self.table, self.data, self.op = \
            exchange, sig_req, table, data, op
        self.checked = False

    def _verdict(self) -> None:
        self.checked = True
        t = self.table
        if (t != t[0]).any():
            raise self.exchange.mismatch(self.op, t.tolist())

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
