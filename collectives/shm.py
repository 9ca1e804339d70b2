"""Shared-memory allreduce for ranks on the same host (MPI-3 shared windows).

Why: within one host Open MPI's allreduce moves data through its shared-memory
transport in several copies and reaches only a few GB/s, while a core can copy
10-20 GB/s. Here every rank of the node maps the same memory, so one allreduce is

1. copy-in: rank r copies (a chunk of) its input into its own slot ``S[r]``;
2. sync;
3. reduce-scatter in place: rank r reduces slice r of the chunk over all slots,
   ``S[0][r] = ((S[0][r] op S[1][r]) op S[2][r]) ...`` in local-rank order, so the
   result is bit-identical to that fixed order and computed exactly once;
   with several nodes, slice r is then allreduced with the ranks of the same
   local rank on the other nodes (hierarchical: intra-node reduce, inter-node
   allreduce, intra-node "broadcast" by reading the shared result);
4. sync;
5. copy-out: every rank copies the whole reduced chunk from ``S[0]``.

Synchronisation: the window is locked once with ``Lock_all(MODE_NOCHECK)``
(passive target, as the MPI-3 unified memory model expects for load/store access)
and each sync point is a barrier through counters in the window (``waits.Signals``:
spin, then yield, then sleep on a futex), not ``MPI_Barrier``, whose busy-polling
steals the core of a late rank when cores are shared. Two sets of slots alternate
between chunks (double buffering), so a rank starting chunk i+2 (after the first
barrier of chunk i+1) can never overwrite a slot that another rank still reads for
chunk i: two barriers per chunk suffice.
"""

from __future__ import annotations

import numpy as np
from ._mpi import MPI
from .waits import Signals, header_bytes

_ALIGN = 64  # bytes: slice boundaries on cache lines, so ranks never share a line
SINGLE_STEP_MAX = 4 << 20  # largest fused buffer reduced in one step (allreduce_packed)


class ShmReducer:
    """Allreduce engine over one node communicator (all members share memory).

    Every method is collective over ``node_comm``; all members must call with the
    same element count and dtype (as for any MPI collective).
    """

    def __init__(self, node_comm: MPI.Intracomm, cross_comm: MPI.Intracomm | None,
                 chunk_bytes: int) -> None:
        self.node = node_comm
        self.cross = cross_comm  # same local rank on every node; None on one node
        self.n = node_comm.Get_size()
        self.r = node_comm.Get_rank()
        self.chunk_bytes = max(_ALIGN * self.n, int(chunk_bytes) // _ALIGN * _ALIGN)
        self.cap = 0  # bytes per slot
        self.win: MPI.Win | None = None
        self.slots: list[list[np.ndarray]] = []  # [parity][local rank] -> uint8 view
        self.parity = 0
        self._plans: dict[tuple, tuple] = {}
        self.signals: Signals | None = None

    def _ensure(self, nbytes: int, limit: int) -> None:
        """Slots of at least ``min(nbytes, limit)`` bytes (re-allocating is collective:
        every rank calls with the same arguments, as for the allreduce itself)."""
        want = min(limit, max(nbytes, 1 << 16))
        if want <= self.cap:
            return
        cap = 1 << (want - 1).bit_length()  # grow in powers of two, up to the limit
        cap = min(cap, limit)
        self.free()
        # Each rank allocates its header and its own two slots, so first touch places
        # them near it.
        head = header_bytes(self.n)
        win = MPI.Win.Allocate_shared(head + 2 * cap, 1, comm=self.node)
        win.Lock_all(MPI.MODE_NOCHECK)
        views = []
        for k in range(self.n):
            buf, _ = win.Shared_query(k)
            views.append(np.frombuffer(buf, dtype=np.uint8, count=head + 2 * cap))
        self.signals = Signals([v[:head] for v in views], self.r, win.Sync)
        self.slots = [[v[head:head + cap] for v in views], [v[head + cap:] for v in views]]
        self.win, self.cap, self.parity = win, cap, 0
        self._plans = {}
        win.Sync()
        self.node.Barrier()  # every header is zeroed before anyone reads one

    def _sync(self) -> None:
        self.signals.sync()

    def allreduce(self, src: np.ndarray, dst: np.ndarray, kernel, cross_type=None,
                  cross_op=None, finish=None, chunk: int = 0, ring=None) -> None:
        """``dst = reduce(src over ranks)``; ``src`` may be ``dst`` (in place).

        Args:
            src, dst: C-contiguous NumPy arrays of equal dtype and size.
            kernel: ``f(a, b, out)`` computing ``out = a op b`` (see dtypes.kernel).
            cross_type, cross_op: MPI datatype/op for the inter-node step.
            finish: optional in-place ``f(arr)`` applied once to each reduced slice
                (the division of an average), before anyone copies it out.
            chunk: bytes per step (default: the reducer's ``chunk_bytes``).
            ring: a ``ring.Ring`` over the cross communicator: the inter-node step as a
                ring instead of MPI_Allreduce.
        """
        total = src.size
        if total == 0:
            return
        itemsize = src.itemsize
        chunk = max(_ALIGN * self.n, (chunk or self.chunk_bytes) // _ALIGN * _ALIGN)
        self._ensure(total * itemsize, chunk)
        per_chunk = min(self.cap, chunk) // itemsize
        s_flat = src.reshape(-1)
        d_flat = dst.reshape(-1)
        dtype = src.dtype
        r, cross, sync = self.r, self.cross, self._sync
        for start in range(0, total, per_chunk):
            m = min(per_chunk, total - start)
            parity = self.parity
            self.parity ^= 1
            views, lo, hi = self._plan(dtype, m, parity)
            chunk = s_flat[start:start + m]
            # Only this rank reads slice r of the slots, so its own slice need not be
            # copied in: the reduction takes it from ``src`` directly (n=2: half the
            # copy-in traffic).
            mine = views[r]
            np.copyto(mine[:lo], chunk[:lo])
            np.copyto(mine[hi:], chunk[hi:])
            sync()
            if hi > lo:
                own = chunk[lo:hi]
                acc = views[0][lo:hi]
                # x0 + x1 + ... in local-rank order, x_r read from src.
                first = own if r == 0 else acc
                kernel(first, own if r == 1 else views[1][lo:hi], acc)
                for k in range(2, len(views)):
                    kernel(acc, own if k == r else views[k][lo:hi], acc)
                if ring is not None:
                    ring.allreduce(acc, acc, kernel)
                elif cross is not None:
                    cross.Allreduce(MPI.IN_PLACE, [acc, cross_type], cross_op)
                if finish is not None:
                    finish(acc)
            elif cross is not None and ring is None:
                # Every member of the cross communicator must take part (a ring of
                # empty slices exchanges nothing: the same local rank has the same slice).
                cross.Allreduce(MPI.IN_PLACE, [views[0][:0], cross_type], cross_op)
            sync()
            np.copyto(d_flat[start:start + m], views[0])

    def allreduce_packed(self, count: int, dtype: np.dtype, fill, drain, kernel,
                         cross_type=None, cross_op=None, finish=None, ring=None) -> None:
        """One-step allreduce of ``count`` elements (at most ``SINGLE_STEP_MAX`` bytes)
        whose input the caller writes straight into this rank's slot (``fill(view)``)
        and whose result it reads straight out of shared memory (``drain(view)``).

        grouped_allreduce uses it to pack its arrays into shared memory and unpack them
        from it, saving two copies of the fused buffer.
        """
        if count == 0:
            return
        self._ensure(count * dtype.itemsize, SINGLE_STEP_MAX)
        parity = self.parity
        self.parity ^= 1
        views, lo, hi = self._plan(dtype, count, parity)
        fill(views[self.r])
        self._sync()
        if hi > lo:
            acc = views[0][lo:hi]
            for other in views[1:]:
                kernel(acc, other[lo:hi], acc)
            if ring is not None:
                ring.allreduce(acc, acc, kernel)
            elif self.cross is not None:
                self.cross.Allreduce(MPI.IN_PLACE, [acc, cross_type], cross_op)
            if finish is not None:
                finish(acc)
        elif self.cross is not None and ring is None:
            self.cross.Allreduce(MPI.IN_PLACE, [views[0][:0], cross_type], cross_op)
        self._sync()
        drain(views[0])

    def _plan(self, dtype: np.dtype, m: int, parity: int) -> tuple[list[np.ndarray], int, int]:
        """Typed views of the slots for a chunk of ``m`` elements, and this rank's slice
        ``[lo, hi)`` (boundaries on cache lines). Cached: the hot loop only indexes."""
        key = (dtype, m, parity)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:
                self._plans.clear()
            itemsize = dtype.itemsize
            views = [s[:m * itemsize].view(dtype) for s in self.slots[parity]]
            unit = max(1, _ALIGN // itemsize)
            units = -(-m // unit)
            lo = min(m, (units * self.r // self.n) * unit)
            hi = min(m, (units * (self.r + 1) // self.n) * unit)
            plan = self._plans[key] = (views, lo, hi)
        return plan

    def free(self) -> None:
        if self.win is not None:
            self.slots = []
            self.signals = None
            self._plans = {}
            try:
                self.win.Unlock_all()
                self.win.Free()
            except MPI.Exception:
                pass
            self.win = None
            self.cap = 0
