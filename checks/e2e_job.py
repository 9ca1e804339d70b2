"""The job ``dtrun doctor`` launches end to end: a marker line at each stage, per rank.

Stages: ``started`` (the rank runs: ssh, the remote daemon and the exec all worked),
``init`` (MPI_Init wired the ranks up), ``collective`` (a first allreduce finished),
then with ``--smoke`` a short run of the collectives smoke test. dtrun doctor reads
the markers to time each stage and, when the job hangs, to say at which one.
"""
import os
import socket
import sys
import time

MARK = "DTRUN-E2E"


def mark(stage, rank):
    print(f"{MARK} {stage} {socket.gethostname()} {rank} {time.time():.6f}", flush=True)


def main(argv):
    mark("started", os.environ.get("DTRUN_RANK", "?"))
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mark("init", comm.rank)
    total = comm.allreduce(1)
    if total != comm.size:
        print(f"{MARK} wrong allreduce: {total} != {comm.size}", flush=True)
        return 1
    mark("collective", comm.rank)
    if "--smoke" not in argv:
        return 0
    try:
        from dtrun.collectives import smoke  # lazy: optional on the far host; a missing runtime is reported
    except ImportError as exc:
        print(f"{MARK} no-smoke {exc}", flush=True)
        return 0
    rc = smoke.main(["--ops", "allreduce,broadcast,allgather,alltoall", "--dtypes", "float32,int64",
                     "--sizes", "1,1023", "--timeout", "20"])
    mark("smoke" if rc == 0 else "smoke-failed", comm.rank)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
