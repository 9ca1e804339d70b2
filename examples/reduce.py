"""Reduce: global average of random numbers on rank 0 (mpitutorial.com's reduce_avg.c).

    dtrun -np 3 python examples/reduce.py
"""
import sys

import numpy as np

from dtrun import collectives
PER_RANK = 1000


def numbers_of(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).random(PER_RANK)


def main() -> int:
    comm = collectives.init()
    local_sum = np.array([numbers_of(comm.rank).sum()])
    print(f"rank {comm.rank}: local sum {local_sum[0]:.6f}, local average "
          f"{local_sum[0] / PER_RANK:.6f}", flush=True)
    global_sum = comm.reduce(local_sum, op="sum", root=0)
    low = comm.reduce(np.array([numbers_of(comm.rank).min()]), op="min", root=0)
    ok = True
    if comm.rank == 0:
        everything = np.concatenate([numbers_of(r) for r in range(comm.size)])
        avg = global_sum[0] / (PER_RANK * comm.size)
        ok = bool(np.isclose(avg, everything.mean(), rtol=1e-12)) and low[0] == everything.min()
        print(f"total sum {global_sum[0]:.6f}, average {avg:.6f} (numpy: "
              f"{everything.mean():.6f}), minimum {low[0]:.6f}: {'ok' if ok else 'WRONG'}",
              flush=True)
    verdict = comm.broadcast(np.array([ok], dtype=np.uint8), root=0)
    return 0 if verdict[0] else 1


if __name__ == "__main__":
    sys.exit(main())
