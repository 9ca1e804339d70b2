"""Allreduce: standard deviation of numbers spread over ranks
(mpitutorial.com's reduce_stddev.c). The mean is needed on every rank, so it comes
from an allreduce; the squared differences are then reduced onto rank 0.

    dtrun -np 3 python examples/allreduce.py
"""
import sys

import numpy as np

from dtrun import collectives
PER_RANK = 1000


def numbers_of(rank: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).random(PER_RANK)


def main() -> int:
    comm = collectives.init()
    mine = numbers_of(comm.rank)
    total = comm.allreduce(np.array([mine.sum()]))
    mean = total[0] / (PER_RANK * comm.size)
    sq = comm.reduce(np.array([((mine - mean) ** 2).sum()]), op="sum", root=0)
    # Also average a vector in place on every rank (what data-parallel training does).
    grad = np.full(8, float(comm.rank))
    comm.allreduce(grad, op="avg", inplace=True)
    ok = bool(np.all(grad == (comm.size - 1) / 2))
    print(f"rank {comm.rank}: mean {mean:.6f}, averaged vector {grad[:3]} "
          f"{'ok' if ok else 'WRONG'}", flush=True)
    if comm.rank == 0:
        everything = np.concatenate([numbers_of(r) for r in range(comm.size)])
        stddev = np.sqrt(sq[0] / (PER_RANK * comm.size))
        good = bool(np.isclose(mean, everything.mean(), rtol=1e-12)
                    and np.isclose(stddev, everything.std(), rtol=1e-9))
        print(f"mean {mean:.6f}, standard deviation {stddev:.6f} (numpy: {everything.std():.6f})"
              f": {'ok' if good else 'WRONG'}", flush=True)
        ok &= good
    verdict = comm.allreduce(np.array([ok], dtype=np.uint8), op="min")
    return 0 if verdict[0] else 1


if __name__ == "__main__":
    sys.exit(main())
