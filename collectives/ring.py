"""Ring allreduce: reduce-scatter then allgather around the ranks of a communicator.

Why: between hosts the bytes on each link are what count. A ring sends 2(p-1)/p of the
buffer per rank whatever p is, in p-1 + p-1 steps of one neighbour exchange each,
which is what an MPI library picks for large messages when its tuning knows the
network; Open MPI's default decision rules are tuned for other networks and sometimes
pick worse. The path selector (``tuning.py``) keeps this one only for the sizes where it
measured faster than MPI's own choice.

Exactness: part k of the buffer is reduced along one chain of ranks and then copied to
everyone, so every rank ends with the same bits, and integer results are exact.
Elements are split into ``p`` parts whose sizes differ by at most one element, so any
count works (including fewer elements than ranks: some parts are empty).
"""

from __future__ import annotations

import numpy as np

from ._mpi import MPI

_TAG = 0x7E11


def part_bounds(count: int, p: int) -> list[int]:
    """``bounds[k]:bounds[k+1]`` is part k of ``count`` elements in ``p`` near-equal parts."""
    return [count * k // p for k in range(p + 1)]


class Ring:
    """Ring allreduce over ``comm`` (an ``MPI.Intracomm``). Collective over ``comm``;
    every member calls with the same count and dtype. Pass a communicator of its own
    (a ``Dup``): a user's pending receive from any source with any tag on the user's
    communicator would otherwise match the ring's messages."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.p = comm.Get_size()
        self.r = comm.Get_rank()
        self.right = (self.r + 1) % self.p
        self.left = (self.r - 1) % self.p
        self._tmp = np.empty(0, dtype=np.uint8)

    def _scratch(self, nbytes: int) -> np.ndarray:
        if self._tmp.size < nbytes:
            self._tmp = np.empty(max(nbytes, 1 << 12), dtype=np.uint8)
        return self._tmp

    def allreduce(self, src: np.ndarray, dst: np.ndarray, kernel, finish=None) -> None:
        """``dst = reduce(src over ranks)`` (``src`` may be ``dst``): ``kernel(a, b, out)``
        computes ``out = a op b``; ``finish`` (an average's division) runs once per part."""
        flat = dst.reshape(-1)
        if src is not dst:
            np.copyto(flat, src.reshape(-1))
        p, r = self.p, self.r
        if p == 1 or flat.size == 0:
            if finish is not None and flat.size:
                finish(flat)
            return
        b = part_bounds(flat.size, p)
        raw = flat.view(np.uint8)
        isz = flat.itemsize
        tmp = self._scratch((b[1] - b[0] + 1) * isz).view(np.uint8)
        send = self.comm.Sendrecv
        right, left, byte = self.right, self.left, MPI.BYTE
        # Reduce-scatter: after step s, part (r - s - 1) holds the reduction of ranks
        # r - s - 1 .. r; after p - 1 steps rank r owns the full part (r + 1) % p.
        for s in range(p - 1):
            si, ri = (r - s) % p, (r - s - 1) % p
            n_in = b[ri + 1] - b[ri]
            send([raw[b[si] * isz:b[si + 1] * isz], byte], right, _TAG,
                 [tmp[:n_in * isz], byte], left, _TAG)
            if n_in:
                mine = flat[b[ri]:b[ri + 1]]
                kernel(tmp[:n_in * isz].view(flat.dtype), mine, mine)
        own = (r + 1) % p
        if finish is not None and b[own + 1] > b[own]:
            finish(flat[b[own]:b[own + 1]])
        # Allgather: pass the finished parts around the ring.
        for s in range(p - 1):
            si, ri = (r + 1 - s) % p, (r - s) % p
            send([raw[b[si] * isz:b[si + 1] * isz], byte], right, _TAG,
                 [raw[b[ri] * isz:b[ri + 1] * isz], byte], left, _TAG)
