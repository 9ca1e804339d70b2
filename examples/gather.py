"""Gather: every rank's data on rank 0, equal lengths (gather) and unequal (gatherv).

    dtrun -np 3 python examples/gather.py
"""
import sys

import numpy as np

from dtrun import collectives
def main() -> int:
    comm = collectives.init()
    rank, size = comm.rank, comm.size
    mine = np.array([[rank, rank * rank]], dtype=np.int64)
    table = comm.gather(mine, root=0)
    # Rank r contributes r+1 values (all equal to r): lengths differ.
    ragged = comm.gatherv(np.full(rank + 1, rank, dtype=np.int32), root=0)
    ok = True
    if rank == 0:
        print("rank, rank^2 as gathered on rank 0:")
        for row in table:
            print(f"  {row[0]:>3} {row[1]:>5}")
        ok = bool(np.array_equal(table, [[r, r * r] for r in range(size)]))
        expected = np.concatenate([np.full(r + 1, r) for r in range(size)])
        print(f"gatherv of unequal parts: {ragged.tolist()}")
        ok &= bool(np.array_equal(ragged, expected))
        print("ok" if ok else "WRONG", flush=True)
    verdict = comm.broadcast(np.array([ok], dtype=np.uint8), root=0)
    return 0 if verdict[0] else 1


if __name__ == "__main__":
    sys.exit(main())
