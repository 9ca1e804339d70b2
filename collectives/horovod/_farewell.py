"""How a rank learns that another rank shut Horovod down, so that it never waits forever.

Horovod's coordinator notices a rank's ``hvd.shutdown()`` (explicit, or at the end of its
program: ``init`` registers it with ``atexit``) and fails every pending and later
collective on the other ranks with "Horovod has been shut down". dtrun has no coordinator
thread, so the shutdown is announced: at ``init`` every rank posts one receive per other
rank on a private duplicate of the job's communicator; ``shutdown`` sends this rank's number,
and how many negotiation exchanges it took part in, to every rank still listening. A rank that waits for the others (a negotiation round,
``collectives.horovod._core.Engine``) waits for its request *or* one of those messages,
whichever comes first (``MPI_Waitany``: no polling loop, no added latency).

A rank that dies without shutting down (a crash, a signal, ``os._exit``) is the launcher's
to handle: MPI reports a process that ends without ``MPI_Finalize`` and dtrun stops the job,
naming that rank.

NumPy only at import; the communicator comes from ``init``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

TAG = 0x4856  # "HV"
SEND_WAIT_S = 2.0  # how long shutdown waits for its announcements to leave
_SENT: list = []   # announcements still in flight at shutdown (MPI owns their buffers)


class Farewells:
    """The ranks' shutdown announcements, on a duplicate of ``mpi_comm`` (collective).

    An announcement carries how many negotiation exchanges the rank took part in: a rank
    still inside an exchange the leaving rank completed (its data is on the way) finishes
    that exchange; only the exchanges after it fail."""

    def __init__(self, mpi_comm: Any):
        self.comm = mpi_comm.Dup()
        me, n = self.comm.Get_rank(), self.comm.Get_size()
        self.peers = [r for r in range(n) if r != me]
        self.bufs = [np.full(2, -1, np.int64) for _ in self.peers]
        self.recvs = [self.comm.Irecv(b, source=r, tag=TAG) for b, r in zip(self.bufs, self.peers)]
        self.left: dict[int, int] = {}  # rank heard leaving -> exchanges it took part in
        self.gone: int | None = None    # the rank reported: the first found missing
        self.closed = False

    def check(self, seq: int) -> int | None:
        """A rank that left before exchange number ``seq`` (never taking part in it or any
        later one), or None; never waits."""
        from .._mpi import MPI
        while self.recvs and not self.closed and len(self.left) < len(self.peers):
            i, done = MPI.Request.Testany(self.recvs)
            if not done or i == MPI.UNDEFINED:
                break
            self._heard(i)
        return self._missing(seq)

    def wait(self, request: Any, seq: int) -> int | None:
        """Wait for ``request`` (this rank's exchange number ``seq``) unless a rank left
        before taking part in it. Returns None once ``request`` completed, else that rank
        (``request`` is then abandoned: the job cannot run another collective)."""
        from .._mpi import MPI
        requests = [request, *self.recvs]
        while self.check(seq) is None:
            i = MPI.Request.Waitany(requests)
            if i == 0:
                return None
            self._heard(i - 1)
        return self.gone

    def _heard(self, i: int) -> None:
        self.left[self.peers[i]] = int(self.bufs[i][1])

    def _missing(self, seq: int) -> int | None:
        if self.gone is None:
            self.gone = min((r for r, n in self.left.items() if n <= seq), default=None)
        return self.gone

    def announce(self, me: int, exchanges: int) -> None:
        """This rank shuts down after ``exchanges`` exchanges: stop listening, and tell
        every rank not heard leaving (waiting at most ``SEND_WAIT_S`` for the messages to
        leave)."""
        from .._mpi import MPI
        if self.closed or MPI.Is_finalized():
            return
        self.closed = True
        for req in self.recvs:
            if not req.Test():
                req.Cancel()
                req.Wait()  # cancelled, or its farewell arrived meanwhile
        left = {r for r, b in zip(self.peers, self.bufs) if b[0] == r}
        msg = np.array([me, exchanges], np.int64)
        sends = [self.comm.Isend(msg, dest=r, tag=TAG) for r in self.peers if r not in left]
        deadline = time.monotonic() + SEND_WAIT_S
        while sends and not MPI.Request.Testall(sends) and time.monotonic() < deadline:
            time.sleep(1e-3)
        _SENT.append((msg, sends))
