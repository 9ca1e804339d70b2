"""Point-to-point: ping-pong between pairs of ranks, then a token around a ring.

The collectives version of mpitutorial.com's ping_pong.c and ring.c:
    dtrun -np 2 python examples/p2p.py
Exits non-zero if a value arrives wrong.
"""
import sys

import numpy as np

from dtrun import collectives
PING_PONG_LIMIT = 10


def main() -> int:
    comm = collectives.init()
    rank, size = comm.rank, comm.size
    ok = True

    # Ping-pong: ranks 2k and 2k+1 bounce a counter until it reaches the limit.
    partner = rank ^ 1
    counter = np.zeros(1, dtype=np.int64)
    if partner < size:
        while counter[0] < PING_PONG_LIMIT:
            if rank % 2 == counter[0] % 2:
                counter[0] += 1
                comm.send(counter, partner)
                print(f"rank {rank} sent and incremented ping_pong_count {counter[0]} "
                      f"to {partner}", flush=True)
            else:
                comm.recv(counter, source=partner)
                print(f"rank {rank} received ping_pong_count {counter[0]} from {partner}",
                      flush=True)
        ok &= int(counter[0]) == PING_PONG_LIMIT
    else:
        print(f"rank {rank} has no partner for ping-pong (odd number of ranks)", flush=True)

    # Ring: rank 0 starts a token; each rank adds its rank and passes it on.
    token = np.zeros(1, dtype=np.int64)
    if size > 1:
        if rank != 0:
            comm.recv(token, source=rank - 1)
            print(f"rank {rank} received token {token[0]} from rank {rank - 1}", flush=True)
        token[0] += rank
        comm.send(token, (rank + 1) % size)
        if rank == 0:
            comm.recv(token, source=size - 1)
            print(f"rank 0 received token {token[0]} from rank {size - 1}", flush=True)
            expected = size * (size - 1) // 2
            if token[0] != expected:
                print(f"WRONG: ring token {token[0]}, expected {expected}", flush=True)
                ok = False
    if not ok:
        print(f"rank {rank}: WRONG result", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
