"""Collective benchmark with nccl-tests' conventions (``dtrun bench`` calls ``main``).

    dtrun -np 2 python -m dtrun.collectives.bench -b 8 -e 64M -f 2 -o allreduce --baseline

Flags follow nccl-tests (-b/-e/-f/-w/-n/-d/-r, plus -c for the data check), except that
``-o`` selects the collective (nccl-tests has one binary per collective) and the
reduction op is ``--redop``. Columns: size (B), count (elements), type, redop, root,
then for out-of-place and in-place: time (us), algbw, busbw (GB/s = 1e9 B/s), #wrong.

* size is the total buffer size: for allgather the gathered output, for
  reduce_scatter the input, for alltoall either buffer (as nccl-tests).
* algbw = size / time; busbw = algbw x factor, the factor making numbers comparable
  with link speeds: allreduce 2(n-1)/n; allgather, reduce_scatter, alltoall (n-1)/n;
  broadcast, reduce 1.
* time is the mean per iteration on each rank, the maximum over ranks reported; every
  timed loop starts after a barrier. #wrong counts wrong elements over all ranks in a
  separate, checked run with exact small-integer inputs (``-c 0`` skips it).
* ``--baseline`` times raw mpi4py (``Comm.Allreduce`` etc. with the same buffers,
  datatypes and op) in the same run, interleaved with ours, and prints the ratio
  ours/raw of busbw per size. With ``--rounds R`` both are timed R times, alternating,
  and the fastest round of each is kept, which makes ratios robust on a shared host.
* ``-o grouped``: ``--tensors`` arrays of ``size`` bytes, grouped_allreduce vs one
  allreduce per array (the fusion speedup).
* ``--min-time S``: repeat each timed loop until it lasts about S seconds (at least
  ``-n`` iterations; the count comes from the warm-up and is the same on all ranks).
* ``--bound`` (allreduce): per size, the memcpy bandwidth of this host in the same run
  (``np.copyto`` of the same size on every rank at once) and the fraction of it that
  the allreduce reaches under this accounting: each rank at least reads its N input
  bytes, writes its N output bytes and reads its share (p-1)/p N of the other ranks'
  data, (2 + (p-1)/p) N bytes of traffic, against memcpy's 2 N per N copied. The JSON
  rows also carry the path each size took (``Comm.allreduce_path``).

This module holds the options, the table and ``main``; the runs are in ``bench_runs``.
"""

from __future__ import annotations

import argparse
import json
import sys
from .sizes import parse_bytes

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "reduce")
DTYPE_NAMES = {"float": "float32", "float32": "float32", "double": "float64",
               "float64": "float64", "half": "float16", "float16": "float16",
               "bfloat16": "bfloat16", "int32": "int32", "int": "int32", "int64": "int64",
               "int8": "int8", "uint8": "uint8", "uint32": "uint32", "uint64": "uint64"}
_SHORT = {"float32": "float", "float64": "double", "float16": "half"}


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (``dtrun bench --help`` shows them, and routes them here)."""
    p = argparse.ArgumentParser(
        prog="python -m dtrun.collectives.bench",
        description="Time collectives over a range of sizes and print size, time, algbw and busbw "
                    "(GB/s) per size, as nccl-tests does, with a check of the results (#wrong). "
                    "Sizes go from -b to -e, multiplied by -f each step.")
    p.add_argument("-b", "--minbytes", type=parse_bytes, default=parse_bytes("8"), help="smallest size (8, 1K, 64M, 1G; default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_bytes, default=parse_bytes("64M"), help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step (default 2)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations per size (default 5)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("-o", "--op", default="allreduce",
                   choices=COLLECTIVES + ("all", "grouped"),
                   help="collective to time (nccl-tests: one binary each)")
    p.add_argument("--redop", default="sum", choices=("sum", "prod", "min", "max", "avg"), help="reduction op (default sum)")
    p.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPE_NAMES), help="element type (default float)")
    p.add_argument("-r", "--root", type=int, default=0, help="root rank of broadcast and reduce (default 0)")
    p.add_argument("-c", "--check", type=int, default=1, help="1: count wrong values")
    p.add_argument("--baseline", action="store_true",
                   help="also time raw mpi4py on the same buffers; print the ratio")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate ours/raw this many times (each round in the reverse order of the one before)")
    p.add_argument("--stat", default="best", choices=("best", "median"),
                   help="which round counts: each one's best (default), or the median round, as a job sees it")
    p.add_argument("--tensors", type=int, default=256, help="arrays for -o grouped")
    p.add_argument("--path", default=None,
                   choices=("mpi", "shm", "shm+hierarchical", "shm+ring", "ring", "stream"),
                   help="ours: take this allreduce path at every size (default: measured)")
    p.add_argument("--min-time", type=float, default=0.0,
                   help="repeat each timed loop until it lasts about this many seconds")
    p.add_argument("--bound", action="store_true",
                   help="allreduce: also measure memcpy bandwidth per size and report the "
                        "fraction of it reached")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.stepfactor < 2:
        p.error("-f/--stepfactor must be >= 2")
    if args.minbytes > args.maxbytes:
        p.error("-b/--minbytes is larger than -e/--maxbytes")
    return args


def sizes(args) -> list[int]:
    out, s = [], args.minbytes
    while s <= args.maxbytes:
        out.append(s)
        s *= args.stepfactor
    return out


def format_table(rows: list[dict], baseline: bool) -> str:
    if rows and rows[0]["op"] == "grouped":
        lines = [f"# grouped_allreduce of {rows[0]['tensors']} arrays vs one allreduce each",
                 "#  size(B)/array     count   type   fused(us)  separate(us)  speedup  #wrong"
                 + ("  raw-separate(us)  speedup" if "raw_speedup" in rows[0] else "")
                 + ("  bound(us)  frac  speedup-at-bound" if "bound_us" in rows[0] else "")]
        for r in rows:
            line = (f"{r['size']:>14} {r['count']:>9} {_SHORT.get(r['type'], r['type']):>6} "
                    f"{r['fused_time_us']:>11.1f} {r['separate_time_us']:>13.1f} "
                    f"{r['speedup']:>8.2f} {r['wrong']:>7}")
            if "raw_speedup" in r:
                line += f" {r['raw_separate_time_us']:>17.1f} {r['raw_speedup']:>8.2f}"
            if "bound_us" in r:
                line += (f" {r['bound_us']:>10.1f} {r['bound_frac']:>5.2f} "
                         f"{r['speedup_at_bound']:>17.2f}")
            lines.append(line)
        return "\n".join(lines)
    head1 = ("#" + " " * 62 + "out-of-place" + " " * 23 + "in-place")
    head2 = ("#       size         count      type   redop    root     time   algbw   busbw "
             "#wrong     time   algbw   busbw #wrong")
    head3 = ("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)"
             "            (us)  (GB/s)  (GB/s)       ")
    if baseline:
        head1 += " " * 18 + "raw mpi4py: out-of-place          in-place"
        head2 += "     time   busbw  ratio     time   busbw  ratio"
        head3 += "     (us)  (GB/s)            (us)  (GB/s)       "
    lines = [f"# Collective: {rows[0]['op']}, {rows[0]['nranks']} ranks" if rows else "#",
             head1, head2, head3]
    for r in rows:
        line = (f"{r['size']:>12} {r['count']:>13} {_SHORT.get(r['type'], r['type']):>9} "
                f"{r['redop']:>7} {r['root']:>7}")
        for v in ("oop", "ip"):
            line += (f" {r[f'{v}_time_us']:>8.2f} {r[f'{v}_algbw']:>7.2f} {r[f'{v}_busbw']:>7.2f}"
                     f" {r[f'{v}_wrong']:>6}")
        if baseline:
            for v in ("oop", "ip"):
                line += (f" {r[f'raw_{v}_time_us']:>8.2f} {r[f'raw_{v}_busbw']:>7.2f}"
                         f" {r[f'{v}_ratio']:>6.2f}")
        lines.append(line)
    return "\n".join(lines)


def avg_busbw(rows: list[dict]) -> float:
    vals = [r[k] for r in rows for k in ("oop_busbw", "ip_busbw", "fused_busbw") if k in r]
    return sum(vals) / len(vals) if vals else 0.0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on all ranks; rank 0 prints. Returns 0, or 1 if any #wrong."""
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    from . import bench_runs  # lazy: initialises MPI; the dtrun CLI imports bench for its parser
    ops = list(COLLECTIVES) if args.op == "all" else [args.op]
    comm, sections, handoff, handoff_end = bench_runs.measure(args, ops, DTYPE_NAMES[args.datatype],
                                                              sizes(args))
    all_rows = [r for rows in sections for r in rows]
    wrong = sum(max(r.get("oop_wrong", 0), 0) + max(r.get("ip_wrong", 0), 0) + r.get("wrong", 0)
                for r in all_rows)
    if comm.rank == 0:
        if args.json:
            print(json.dumps({"nranks": comm.size, "nnodes": comm.nnodes,
                              "shm_barrier_ns": handoff, "shm_barrier_ns_end": handoff_end,
                              "paths": comm.allreduce_paths(),
                              "args": {k: v for k, v in vars(args).items()},
                              "rows": all_rows, "avg_busbw": avg_busbw(all_rows),
                              "wrong": wrong}, indent=1))
        else:
            print(f"# collectives.bench: {comm.size} ranks on {comm.nnodes} host(s), "
                  f"{args.iters} iters, {args.warmup_iters} warmup, rounds {args.rounds}"
                  + (f", shared-memory barrier {handoff:.0f} ns at the start, "
                     f"{handoff_end:.0f} ns at the end" if handoff and handoff_end else ""))
            for rows in sections:
                print(format_table(rows, args.baseline and rows[0]["op"] != "grouped"))
            print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
            print(f"# Avg bus bandwidth    : {avg_busbw(all_rows):.4g}")
        sys.stdout.flush()
    comm.barrier()  # a non-zero exit makes mpirun kill the others: let rank 0 print first
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
