"""Ranks that call collectives with different arguments: every rank must raise.

Run under dtrun with 2, 3 or 4 ranks:

    dtrun -np 3 python -m tests.mismatch_cases [--only NAME,...]

Even ranks make one call, odd ranks another (with 3 ranks, ranks 0 and 2 agree: a
mismatch that leaves some ranks with partial sums when it goes unnoticed). Each case
runs on a fresh ``Comm`` over a ``Dup`` of COMM_WORLD, on one layout (a forced
allreduce path, the measured table, no compiled engine, or emulated hosts), and prints
one ``MISMATCH {json}`` line per rank and case: ``raised`` (MismatchError, with its
message), ``returned`` (the call finished: a silent result), or ``error`` (another
exception). A case that does not finish within ``MISMATCH_CASE_TIMEOUT`` seconds prints
``MISMATCH-HANG name`` and aborts the job.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

from dtrun import collectives
from dtrun.collectives import MismatchError


def _f32(n):
    return np.ones(n, np.float32)


# name -> (layout, call(comm, odd) -> result, needles every message must hold)
def _allreduce_cases(layout: str) -> dict:
    big = 4 << 20  # float32 elements: 16 MiB, another path than 8 elements in the tables
    return {
        f"allreduce_count_{layout}": (layout, lambda c, odd: c.allreduce(_f32(20 if odd else 10)),
                                      ["10 x float32", "20 x float32"]),
        f"allreduce_dtype_{layout}": (layout, lambda c, odd: c.allreduce(
            np.ones(8, np.int32 if odd else np.float32)), ["8 x float32", "8 x int32"]),
        f"allreduce_op_{layout}": (layout, lambda c, odd: c.allreduce(_f32(8), op="max" if odd else "sum"),
                                   ["op sum", "op max"]),
        f"allreduce_inplace_count_{layout}": (layout, lambda c, odd: c.allreduce(
            _f32(20 if odd else 10), inplace=True), ["10 x float32", "20 x float32"]),
        f"allreduce_size_paths_{layout}": (layout, lambda c, odd: c.allreduce(_f32(big if odd else 2)),
                                           ["2 x float32", f"{big} x float32"]),
    }


def _grouped(c, odd, kind):
    if kind == "len":
        arrays = [_f32(16 if odd else 8), _f32(16 if odd else 8)]
    elif kind == "count":
        arrays = [_f32(8) for _ in range(3 if odd else 2)]
    elif kind == "dtype":
        arrays = [_f32(8), np.ones(8, np.int32 if odd else np.float32)]
    else:  # op
        return c.grouped_allreduce([_f32(8), _f32(8)], op="max" if odd else "sum")
    return c.grouped_allreduce(arrays)


def _other_cases(layout: str) -> dict:
    s = layout
    return {
        f"reduce_count_{s}": (s, lambda c, odd: c.reduce(_f32(20 if odd else 10)),
                              ["10 x float32", "20 x float32"]),
        f"reduce_op_{s}": (s, lambda c, odd: c.reduce(_f32(8), op="min" if odd else "sum"),
                           ["op sum", "op min"]),
        f"reduce_root_{s}": (s, lambda c, odd: c.reduce(_f32(8), root=1 if odd else 0),
                             ["root 0", "root 1"]),
        f"broadcast_root_{s}": (s, lambda c, odd: c.broadcast(_f32(8), root=1 if odd else 0),
                                ["root 0", "root 1"]),
        f"broadcast_count_{s}": (s, lambda c, odd: c.broadcast(_f32(20 if odd else 10)),
                                 ["10 x float32", "20 x float32"]),
        f"allgather_count_{s}": (s, lambda c, odd: c.allgather(_f32(20 if odd else 10)),
                                 ["10 x float32", "20 x float32"]),
        f"reduce_scatter_count_{s}": (s, lambda c, odd: c.reduce_scatter(
            _f32(c.size * (4 if odd else 2))), ["x float32"]),
        f"alltoall_dtype_{s}": (s, lambda c, odd: c.alltoall(
            np.ones(c.size * 2, np.int32 if odd else np.float32)), ["float32", "int32"]),
        f"gather_root_{s}": (s, lambda c, odd: c.gather(_f32(4), root=1 if odd else 0),
                             ["root 0", "root 1"]),
        f"scatter_root_{s}": (s, lambda c, odd: c.scatter(_f32(4 * c.size), root=1 if odd else 0),
                              ["root 0", "root 1"]),
        f"gatherv_root_{s}": (s, lambda c, odd: c.gatherv(_f32(4), root=1 if odd else 0),
                              ["gatherv", "root 0", "root 1"]),
        f"kind_allreduce_broadcast_{s}": (s, lambda c, odd: c.broadcast(_f32(8)) if odd
                                          else c.allreduce(_f32(8)), ["allreduce", "broadcast"]),
        f"kind_barrier_allreduce_{s}": (s, lambda c, odd: c.barrier() if odd
                                        else c.allreduce(_f32(8)), ["allreduce", "barrier"]),
        f"grouped_shapes_{s}": (s, lambda c, odd: _grouped(c, odd, "len"),
                                ["2 arrays, 16 elements", "2 arrays, 32 elements",
                                 "first difference at array 0", "8 x float32", "16 x float32"]),
        f"grouped_count_{s}": (s, lambda c, odd: _grouped(c, odd, "count"),
                               ["2 arrays", "3 arrays", "array 2", "no such array"]),
        f"grouped_dtype_{s}": (s, lambda c, odd: _grouped(c, odd, "dtype"),
                               ["first difference at array 1", "8 x float32", "8 x int32"]),
        f"grouped_op_{s}": (s, lambda c, odd: _grouped(c, odd, "op"), ["grouped_allreduce of 2 arrays"]),
        f"iallreduce_count_{s}": (s, lambda c, odd: c.iallreduce(_f32(20 if odd else 10)).wait(),
                                  ["10 x float32", "20 x float32"]),
        f"ibroadcast_root_{s}": (s, lambda c, odd: c.ibroadcast(_f32(8), root=1 if odd else 0).wait(),
                                 ["root 0", "root 1"]),
    }


def _cases() -> dict:
    cases = {}
    for layout in ("shm1", "shm2", "shm", "mpi", "auto", "nocompiled", "hosts"):
        cases.update(_allreduce_cases(layout))
    for layout in ("auto", "nocompiled", "hosts"):
        cases.update(_other_cases(layout))
    return cases


CASES = _cases()


def make_comm(layout: str, world) -> collectives.Comm:
    """A Comm over a Dup of ``world`` (an mpi4py communicator) for ``layout``."""
    mpi = world.Dup()
    if layout in ("shm1", "shm2", "shm", "mpi"):
        from dtrun.collectives import shm1
        if layout in ("shm1", "shm2") and not shm1.available():
            layout = "shm"
        return collectives.Comm(mpi, path=layout)
    if layout == "auto":
        return collectives.Comm(mpi)
    if layout == "nocompiled":  # no engine: the check rides in a small MPI allreduce
        old = os.environ.get("DTRUN_COMPILED")
        os.environ["DTRUN_COMPILED"] = "0"
        try:
            return collectives.Comm(mpi)
        finally:
            if old is None:
                os.environ.pop("DTRUN_COMPILED")
            else:
                os.environ["DTRUN_COMPILED"] = old
    # "hosts": emulated hosts: of 2 ranks with 4 ranks (shm+hierarchical, shm+ring), else
    # of one rank each (ring, MPI)
    rank = mpi.Get_rank()
    per = 2 if mpi.Get_size() >= 4 else 1
    return collectives.Comm(mpi, node_comm=mpi.Split(rank // per, rank))


def run(name: str, world) -> dict:
    layout, call, _ = CASES[name]
    comm = make_comm(layout, world)
    odd = comm.rank % 2 == 1
    try:
        out = call(comm, odd)
    except MismatchError as e:
        result = {"status": "raised", "message": str(e)}
    except Exception as e:  # noqa: BLE001 - reported, the test judges it
        result = {"status": "error", "message": f"{type(e).__name__}: {e}"}
    else:
        total = None if out is None else float(np.sum(np.asarray(out, dtype=np.float64)))
        result = {"status": "returned", "message": f"sum of result {total}"}
    world.Barrier()
    return {"case": name, "rank": comm.rank, **result}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = argv[argv.index("--only") + 1].split(",") if "--only" in argv else list(CASES)
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    limit = float(os.environ.get("MISMATCH_CASE_TIMEOUT", "20"))
    current = {"name": None, "since": time.monotonic()}

    def watchdog():
        while True:
            time.sleep(0.5)
            if current["name"] and time.monotonic() - current["since"] > limit:
                print(f"MISMATCH-HANG {current['name']}", flush=True)
                world.Abort(3)
    threading.Thread(target=watchdog, daemon=True).start()
    collectives.init()
    for name in names:
        current.update(name=name, since=time.monotonic())
        print("MISMATCH " + json.dumps(run(name, world)), flush=True)
    current["name"] = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
