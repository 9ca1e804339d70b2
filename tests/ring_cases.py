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
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

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


def main(mode: str) -> None:
    comm = MPI.COMM_WORLD
    if mode == "same-ports":
        same_ports(comm)
        return
    ring = StreamRing(comm.Dup(), chunk_bytes=64 * 1024)
    {"exact": exact, "mismatch": mismatch, "peer-closes": peer_closes}[mode](comm, ring)


if __name__ == "__main__":
    main(sys.argv[1])
