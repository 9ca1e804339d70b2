"""Broadcast: rank 0's array reaches every rank (mpitutorial.com's my_bcast.c).

Compares the library's broadcast with the naive version the tutorial starts from
(root sends to every rank one by one) and checks both.
    dtrun -np 3 python examples/broadcast.py
"""
import sys

import numpy as np

from dtrun import collectives
N = 100_000
TRIALS = 10


def naive_bcast(comm, data: np.ndarray, root: int) -> None:
    if comm.rank == root:
        for dest in range(comm.size):
            if dest != root:
                comm.send(data, dest)
    else:
        comm.recv(data, source=root)


def main() -> int:
    from mpi4py import MPI
    comm = collectives.init()
    expected = np.arange(N, dtype=np.float64)
    timings = {}
    ok = True
    for name in ("naive", "library"):
        total = 0.0
        for _ in range(TRIALS):
            data = expected.copy() if comm.rank == 0 else np.zeros(N)
            comm.barrier()
            t0 = MPI.Wtime()
            if name == "naive":
                naive_bcast(comm, data, 0)
            else:
                comm.broadcast(data, root=0, inplace=True)
            total += MPI.Wtime() - t0
            ok &= bool(np.array_equal(data, expected))
        timings[name] = total / TRIALS
    if comm.rank == 0:
        print(f"broadcast of {N * 8} bytes to {comm.size} ranks: naive "
              f"{timings['naive'] * 1e6:.1f} us, library {timings['library'] * 1e6:.1f} us")
    print(f"rank {comm.rank}: data[:3] = {data[:3]}, {'ok' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
