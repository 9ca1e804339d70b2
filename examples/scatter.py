"""Scatter and gather: average of random numbers (mpitutorial.com's avg.c).

Rank 0 creates random numbers, scatters equal parts, every rank averages its part,
rank 0 gathers the partial averages and averages them.
    dtrun -np 3 python examples/scatter.py
"""
import sys

import numpy as np

from dtrun import collectives
PER_RANK = 1000


def main() -> int:
    comm = collectives.init()
    numbers = None
    if comm.rank == 0:
        numbers = np.random.default_rng(2024).random(PER_RANK * comm.size)
    part = comm.scatter(numbers, root=0, out=np.empty(PER_RANK))
    sub_avg = np.array([part.mean()])
    print(f"rank {comm.rank}: average of my {PER_RANK} numbers is {sub_avg[0]:.6f}", flush=True)
    sub_avgs = comm.gather(sub_avg, root=0)
    ok = True
    if comm.rank == 0:
        avg = sub_avgs.mean()
        direct = numbers.mean()
        ok = bool(np.isclose(avg, direct, rtol=1e-12, atol=0))
        print(f"average of all elements is {avg:.6f}; computed directly {direct:.6f}: "
              f"{'ok' if ok else 'WRONG'}", flush=True)
    # Everybody agrees on the verdict, so the exit code is the same on every rank.
    verdict = comm.broadcast(np.array([ok], dtype=np.uint8), root=0)
    return 0 if verdict[0] else 1


if __name__ == "__main__":
    sys.exit(main())
