"""dtrun.collectives.streamring under a real job, one behaviour per mode (tests/test_streamring.py).

Usage: python tests/ring_cases.py MODE   (under ``dtrun -np N``; prints ``RESULT {json}``)

Modes:
  exact     buckets of many sizes (0, 1, fewer elements than ranks, sizes that do not
            split evenly, several chunks) and dtypes, many in flight at once: each result
            equals MPI_Allreduce's (bit for bit for integers, to rounding for floats) and
            is bit-identical on every rank; ``finish`` runs once per element
  mismatch  rank 1 submits one element more than the others: every rank raises
            RingError naming the sizes, none returns a wrong sum
  peer-closes
            rank 1 closes its connections instead of taking part: every other rank's
            ``wait`` raises RingError (the failure travels round the ring) instead of
            blocking
  same-ports
            two rings one after the other on the same fixed ports (RING_TEST_PORTS=LOW-HIGH,
            one port per rank): the second listens at once, though the first one's
            connections still hold those ports in TIME_WAIT
  reopen    60 rings one after the other, each closed right after its last bucket and the
            next opened at once: every sum is right, no rank fails because its neighbour
            closed first, and no ring thread outlives its close()
  done-first
            2 ranks: rank 0's last send returns only after rank 1, which has all it needs,
            has closed the ring (held until rank 0's receiver has seen the close, never
            for a fixed time): rank 0's bucket still finishes, exact; its next bucket is
            a RingError saying rank 1 closed the ring's connection
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from dtrun.collectives.streamring import RingError, StreamRing


def report(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


SIZES = (0, 1, 2, 3, 7, 1000, 65537, 300_001)
DTYPES = ("float32", "float64", "int32", "int64", "float16")


def exact(comm, ring: StreamRing) -> None:
    r = comm.Get_rank()
    rng = np.random.default_rng(1234 + r)
    bufs, want = [], []
    for dt in DTYPES:
        for n in SIZES:
            if np.dtype(dt).kind == "f":
                x = rng.standard_normal(n).astype(dt)
            else:
                x = rng.integers(-1000, 1000, n).astype(dt)
            ref = np.empty_like(x)
            if dt == "float16":  # MPI has no float16: the reference sums in float64
                ref = comm.allreduce(x.astype(np.float64), op=MPI.SUM)
            else:
                comm.Allreduce(x, ref, op=MPI.SUM)
            bufs.append(x)
            want.append(ref)
    finished = []
    jobs = [ring.submit(b, finish=(lambda v: finished.append(v.size))) for b in bufs]
    for j in jobs:
        ring.wait(j)
    bad = []
    for i, (got, ref) in enumerate(zip(bufs, want)):
        if got.dtype.kind == "i":
            ok = np.array_equal(got, ref)
        else:
            tol = 2e-2 if got.dtype == np.float16 else 1e-5
            ok = np.allclose(got.astype(np.float64), ref, rtol=tol, atol=tol)
        if not ok:
            bad.append(f"{got.dtype}[{got.size}]")
    digests = comm.allgather([hashlib.sha256(b.tobytes()).hexdigest() for b in bufs])
    report(rank=r, bad=bad, identical=all(d == digests[0] for d in digests),
           finished=sum(finished), total=sum(b.size for b in bufs))


def mismatch(comm, ring: StreamRing) -> None:
    n = 100_001 + (1 if comm.Get_rank() == 1 else 0)
    x = np.ones(n, np.float32)
    try:
        ring.wait(ring.submit(x))
        report(rank=comm.Get_rank(), error=None, first=float(x[0]))
    except RingError as e:
        report(rank=comm.Get_rank(), error=str(e))


def peer_closes(comm, ring: StreamRing) -> None:
    if comm.Get_rank() == 1:
        ring.close()
        report(rank=1, error=None)
        return
    x = np.ones(1_000_000, np.float32)
    try:
        ring.wait(ring.submit(x))
        report(rank=comm.Get_rank(), error=None)
    except RingError as e:
        report(rank=comm.Get_rank(), error=str(e))


def same_ports(comm) -> None:
    low, high = map(int, os.environ["RING_TEST_PORTS"].split("-"))
    rounds = []
    for _ in range(2):
        try:
            ring = StreamRing(comm.Dup(), ports=(low, high))
            x = np.ones(1000, np.float32)
            ring.wait(ring.submit(x))
            rounds.append(float(x[0]))
            for closing in range(comm.Get_size()):  # rank 0 first: its ports in TIME_WAIT
                if closing == comm.Get_rank():
                    ring.close()
                comm.Barrier()
        except RingError as e:
            rounds.append(str(e))
        comm.Barrier()
    report(rank=comm.Get_rank(), rounds=rounds)


class _HoldLastSend:
    """The ring's outgoing socket, whose ``hold``-th payload send returns only once the
    ring has seen the previous rank close (or broken): the widest form of the race
    between a rank's last send returning and its neighbour, done, closing the ring."""

    def __init__(self, sock, ring: StreamRing, hold: int) -> None:
        self._sock, self._ring, self._left = sock, ring, hold

    def sendall(self, data, *flags) -> None:
        self._sock.sendall(data, *flags)
        if flags:  # a header
            return
        self._left -= 1
        if self._left == 0:
            end = time.monotonic() + 30
            while time.monotonic() < end and getattr(self._ring, "_left_gone", None) is None \
                    and self._ring._broken is None:
                time.sleep(0.001)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def done_first(comm) -> None:
    ring = StreamRing(comm.Dup())
    x = np.ones(70_001)
    if comm.Get_rank() == 0:  # its second payload send is its last one for this bucket
        ring._out = _HoldLastSend(ring._out, ring, hold=2)
    try:
        ring.wait(ring.submit(x))
        error = None
    except RingError as e:
        error = str(e)
    if comm.Get_rank() == 1:
        ring.close()
        report(rank=1, error=error, exact=bool((x == 2).all()))
        return
    try:
        ring.wait(ring.submit(np.ones(10)))
        later = None
    except RingError as e:
        later = f"{type(e).__name__}: {e}"
    ring.close()
    report(rank=0, error=error, exact=bool((x == 2).all()), later=later)


def reopen(comm) -> None:
    wrong, errors, outlived = 0, [], 0
    for k in range(60):
        ring = StreamRing(comm.Dup())
        try:
            for n in (10, 70_001):
                x = np.ones(n)
                ring.wait(ring.submit(x))
                wrong += int(not (x == comm.Get_size()).all())
        except RingError as e:
            errors.append(f"ring #{k}: {e}")
        ring.close()
        outlived += sum(t.name.startswith("dtrun-ring-") for t in threading.enumerate())
        if comm.allreduce(len(errors), op=MPI.MAX):  # every rank stops together
            break
    report(rank=comm.Get_rank(), wrong=wrong, errors=errors, outlived=outlived)


def main(mode: str) -> None:
    comm = MPI.COMM_WORLD
    if mode in ("same-ports", "reopen", "done-first"):
        {"same-ports": same_ports, "reopen": reopen, "done-first": done_first}[mode](comm)
        return
    ring = StreamRing(comm.Dup(), chunk_bytes=64 * 1024)
    {"exact": exact, "mismatch": mismatch, "peer-closes": peer_closes}[mode](comm, ring)


if __name__ == "__main__":
    main(sys.argv[1])
