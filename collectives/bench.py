"""Collective benchmark with nccl-tests' conventions (``dtrun bench`` calls ``main``).

    dtrun -np 2 python -m collectives.bench -b 8 -e 64M -f 2 -o allreduce --baseline

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
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from .sizes import parse_bytes

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "reduce")
DTYPE_NAMES = {"float": "float32", "float32": "float32", "double": "float64",
               "float64": "float64", "half": "float16", "float16": "float16",
               "bfloat16": "bfloat16", "int32": "int32", "int": "int32", "int64": "int64",
               "int8": "int8", "uint8": "uint8", "uint32": "uint32", "uint64": "uint64"}
_SHORT = {"float32": "float", "float64": "double", "float16": "half"}
BUSBW_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "grouped": lambda n: 2 * (n - 1) / n,
}


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (``dtrun bench --help`` shows them, and routes them here)."""
    p = argparse.ArgumentParser(
        prog="python -m collectives.bench",
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
                   choices=("mpi", "shm", "shm+hierarchical", "shm+ring", "ring"),
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


class Timer:
    """Mean time per iteration, max over ranks (MPI.Wtime, barrier first)."""

    def __init__(self, comm) -> None:
        import numpy as np
        from ._mpi import MPI
        self.mpi, self.MPI, self.np = comm.mpi, MPI, np
        self._buf = np.zeros(1, dtype=np.float64)

    def __call__(self, fn: Callable[[], Any], warmup: int, iters: int,
                 min_time: float = 0.0) -> float:
        for _ in range(warmup):
            fn()
        while True:
            self.mpi.Barrier()
            t0 = self.MPI.Wtime()
            for _ in range(iters):
                fn()
            self._buf[0] = self.MPI.Wtime() - t0
            self.mpi.Allreduce(self.MPI.IN_PLACE, self._buf, op=self.MPI.MAX)
            took = float(self._buf[0])
            # With min_time, the timed loop must itself last that long: a count sized from a
            # warm-up that one stall (a 4 ms scheduler tick behind a busy process) made slow
            # gives a loop of a few calls, and one tick in it sets the figure. So grow the
            # count (the same on every rank: the slowest rank's time decides) and time again.
            if took >= min_time or iters >= 10 ** 6:
                return took / max(iters, 1)
            iters = min(10 ** 6, max(2 * iters, int(1.2 * iters * min_time / max(took, 1e-9))))


def _values(n: int, shift: int):
    import numpy as np
    return ((np.arange(n) + shift) % 3 + 1).astype(np.float64)


def build(comm, op: str, nbytes: int, dname: str, redop: str, root: int) -> dict:
    """Buffers and callables for one (op, size): ours and raw, out-of-place and in-place,
    plus a checker returning the number of wrong elements on this rank."""
    import numpy as np
    from ._mpi import MPI

    from . import dtypes as dt
    dtype = dt.BFLOAT16 if dname == "bfloat16" else np.dtype(dname)
    size, rank = comm.size, comm.rank
    count = nbytes // dtype.itemsize
    split = op in ("allgather", "reduce_scatter", "alltoall")
    if split:
        count -= count % size
    per = count // size if split else count
    t = dt.mpi_type(dtype)
    mop = dt.mpi_op(dtype, redop) if op in ("allreduce", "reduce_scatter", "reduce") else None
    mk = lambda n, shift=0: dt.from_float64(_values(n, shift), dtype)  # noqa: E731
    m = comm.mpi
    IP = MPI.IN_PLACE
    b: dict[str, Any] = {"count": count, "nbytes": count * dtype.itemsize}

    if op == "allreduce":
        x, y = mk(count, rank), np.empty(count, dtype)
        b["ours_oop"] = lambda: comm.allreduce(x, redop, out=y)
        b["ours_ip"] = lambda: comm.allreduce(y, redop, inplace=True)
        b["raw_oop"] = lambda: m.Allreduce([x, t], [y, t], mop)
        b["raw_ip"] = lambda: m.Allreduce(IP, [y, t], mop)
        exp = lambda: _expected_reduce(size, count, 0, redop)  # noqa: E731

        def check(inplace):
            if inplace:
                z = mk(count, rank)
                got = comm.allreduce(z, redop, inplace=True)
            else:
                got = comm.allreduce(mk(count, rank), redop, out=np.empty(count, dtype))
            return _wrong(dt.to_float64(got), exp())
    elif op == "reduce":
        x, y = mk(count, rank), np.empty(count, dtype)
        is_root = rank == root
        b["ours_oop"] = lambda: comm.reduce(x, redop, root, out=y if is_root else None)
        b["ours_ip"] = lambda: comm.reduce(y, redop, root, inplace=True)
        b["raw_oop"] = lambda: m.Reduce([x, t], [y, t] if is_root else None, mop, root)
        b["raw_ip"] = lambda: m.Reduce(IP if is_root else [y, t], [y, t] if is_root else None,
                                       mop, root)

        def check(inplace):
            z = mk(count, rank)
            got = comm.reduce(z, redop, root, inplace=inplace)
            if not is_root:
                return 0
            return _wrong(dt.to_float64(got), _expected_reduce(size, count, 0, redop))
    elif op == "broadcast":
        x, y = mk(count, rank), np.empty(count, dtype)
        b["ours_oop"] = lambda: comm.broadcast(x, root, out=y)
        b["ours_ip"] = lambda: comm.broadcast(y, root, inplace=True)
        b["raw_oop"] = lambda: m.Bcast([y, t], root)  # MPI has no out-of-place form
        b["raw_ip"] = lambda: m.Bcast([y, t], root)

        def check(inplace):
            z = mk(count, rank)
            got = comm.broadcast(z, root, inplace=inplace)
            return _wrong(dt.to_float64(got), _values(count, root))
    elif op == "allgather":
        x, y = mk(per, rank), np.empty(count, dtype)
        b["ours_oop"] = lambda: comm.allgather(x, out=y)
        b["ours_ip"] = lambda: comm.allgather(y, inplace=True)
        b["raw_oop"] = lambda: m.Allgather([x, t], [y, t])
        b["raw_ip"] = lambda: m.Allgather(IP, [y, t])
        exp = lambda: np.concatenate([_values(per, k) for k in range(size)])  # noqa: E731

        def check(inplace):
            if inplace:
                z = np.zeros(count, dtype)
                z[rank * per:(rank + 1) * per] = mk(per, rank)
                got = comm.allgather(z, inplace=True)
            else:
                got = comm.allgather(mk(per, rank))
            return _wrong(dt.to_float64(got), exp())
    elif op == "reduce_scatter":
        x, y = mk(count, rank), np.empty(per, dtype)
        b["ours_oop"] = lambda: comm.reduce_scatter(x, redop, out=y)
        b["ours_ip"] = lambda: comm.reduce_scatter(x, redop, inplace=True)
        b["raw_oop"] = lambda: m.Reduce_scatter_block([x, t], [y, t], mop)
        b["raw_ip"] = lambda: m.Reduce_scatter_block(IP, [x, t], mop)

        def check(inplace):
            got = comm.reduce_scatter(mk(count, rank), redop, inplace=inplace)
            full = _expected_reduce(size, count, 0, redop)
            return _wrong(dt.to_float64(got), full[rank * per:(rank + 1) * per])
    elif op == "alltoall":
        x, y = mk(count, rank), np.empty(count, dtype)
        b["ours_oop"] = lambda: comm.alltoall(x, out=y)
        b["ours_ip"] = lambda: comm.alltoall(y, inplace=True)
        b["raw_oop"] = lambda: m.Alltoall([x, t], [y, t])
        b["raw_ip"] = lambda: m.Alltoall(IP, [y, t])

        def check(inplace):
            src = dt.from_float64(np.concatenate([_values(per, 100 * rank + j)
                                                  for j in range(size)]), dtype)
            got = comm.alltoall(src, inplace=inplace)
            exp = np.concatenate([_values(per, 100 * j + rank) for j in range(size)])
            return _wrong(dt.to_float64(got), exp)
    else:
        raise ValueError(op)
    b["check"] = check
    return b


def _expected_reduce(size: int, count: int, shift: int, redop: str):
    import numpy as np
    vals = [_values(count, shift + k) for k in range(size)]
    if redop == "sum":
        return sum(vals)
    if redop == "avg":
        return sum(vals) / size
    if redop == "prod":
        return np.prod(vals, axis=0)
    return (np.min if redop == "min" else np.max)(vals, axis=0)


def _wrong(got, expected) -> int:
    import numpy as np
    got = np.asarray(got).reshape(-1)
    expected = np.asarray(expected).reshape(-1)
    if got.shape != expected.shape:
        return max(got.size, expected.size)
    return int(np.count_nonzero(got != expected))


def run_collective(comm, args, op: str, timer: Timer) -> list[dict]:
    import numpy as np
    from ._mpi import MPI
    dname = DTYPE_NAMES[args.datatype]
    rows = []
    n = comm.size
    for nbytes in sizes(args):
        redop = args.redop if op in ("allreduce", "reduce_scatter", "reduce") else "none"
        if redop == "avg" and dname.startswith("int"):
            redop = "sum"
        b = build(comm, op, nbytes, dname, redop if redop != "none" else "sum", args.root)
        row: dict[str, Any] = {
            "op": op, "size": b["nbytes"], "count": b["count"], "type": dname, "redop": redop,
            "root": args.root if op in ("broadcast", "reduce") else -1, "nranks": n}
        took: dict[str, list] = {}
        keys = ["ours_oop", "raw_oop", "ours_ip", "raw_ip"]
        if args.bound and op == "allreduce":
            src, dst = np.ones(b["nbytes"], np.uint8), np.zeros(b["nbytes"], np.uint8)
            b["memcpy"] = lambda: np.copyto(dst, src)
            keys.append("memcpy")
        for rnd in range(max(1, args.rounds)):
            for key in (keys if rnd % 2 == 0 else keys[::-1]):
                if key.startswith("raw") and not args.baseline:
                    continue
                sec = timer(b[key], max(1, args.warmup_iters), args.iters, args.min_time)
                took.setdefault(key, []).append(sec)
        best = {k: (min(v) if args.stat == "best" else float(np.median(v))) for k, v in took.items()}
        if op == "allreduce":
            row["oop_path"] = comm.allreduce_path(b["nbytes"])
            row["ip_path"] = comm.allreduce_path(b["nbytes"], inplace=True)
        if "memcpy" in best and b["nbytes"]:
            # Traffic per rank under the accounting above, at memcpy's rate (2N per copy).
            need = (2 + (n - 1) / n) * b["nbytes"]
            rate = 2 * b["nbytes"] / best["memcpy"]
            row["memcpy_GBps"] = b["nbytes"] / best["memcpy"] / 1e9
            row["bound_us"] = need / rate * 1e6
            for v in ("oop", "ip"):
                row[f"{v}_bound_frac"] = row["bound_us"] / (best[f"ours_{v}"] * 1e6)
                if f"raw_{v}" in best:  # raw MPI's own fraction: how close it is already
                    row[f"raw_{v}_bound_frac"] = row["bound_us"] / (best[f"raw_{v}"] * 1e6)
        factor = BUSBW_FACTOR[op](n) if n > 1 else 0.0
        for variant in ("oop", "ip"):
            wrong = -1
            if args.check:
                w = np.array([b["check"](variant == "ip")], dtype=np.int64)
                comm.mpi.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)
                wrong = int(w[0])
            for who in ("ours", "raw"):
                key = f"{who}_{variant}"
                if key not in best:
                    continue
                sec = best[key]
                algbw = b["nbytes"] / sec / 1e9 if sec > 0 else 0.0
                prefix = "" if who == "ours" else "raw_"
                row[f"{prefix}{variant}_time_us"] = sec * 1e6
                row[f"{prefix}{variant}_algbw"] = algbw
                row[f"{prefix}{variant}_busbw"] = algbw * factor
            row[f"{variant}_wrong"] = wrong
            if args.baseline:
                raw = row.get(f"raw_{variant}_time_us", 0.0)
                ours = row.get(f"{variant}_time_us", 0.0)
                row[f"{variant}_ratio"] = raw / ours if ours > 0 else 0.0
        rows.append(row)
    return rows


def run_grouped(comm, args, timer: Timer) -> list[dict]:
    """Fusion: grouped_allreduce of --tensors arrays vs one allreduce per array."""
    import numpy as np

    from . import dtypes as dt
    dname = DTYPE_NAMES[args.datatype]
    dtype = dt.BFLOAT16 if dname == "bfloat16" else np.dtype(dname)
    rows = []
    for nbytes in sizes(args):
        count = max(1, nbytes // dtype.itemsize)
        arrays = [dt.from_float64(_values(count, comm.rank), dtype) for _ in range(args.tensors)]

        def separate():
            for a in arrays:
                comm.allreduce(a, inplace=True)
        fused = lambda: comm.grouped_allreduce(arrays)  # noqa: E731
        fns = [("fused", fused), ("separate", separate)]
        if args.baseline:
            # What a user without dtrun writes: one MPI_Allreduce in place per array.
            from ._mpi import MPI
            mop, t = dt.mpi_op(dtype, "sum"), dt.mpi_type(dtype)

            def raw_separate():
                for a in arrays:
                    comm.mpi.Allreduce(MPI.IN_PLACE, [a, t], mop)
            fns.append(("raw_separate", raw_separate))
        total = count * dtype.itemsize * args.tensors
        if args.bound:
            # memcpy of the whole group's bytes on every rank at once (see --bound).
            src, dst = np.ones(total, np.uint8), np.zeros(total, np.uint8)
            fns.append(("memcpy", lambda: np.copyto(dst, src)))
        best: dict[str, float] = {}
        for _ in range(max(1, args.rounds)):
            for key, fn in fns:
                sec = timer(fn, max(1, args.warmup_iters), args.iters, args.min_time)
                best[key] = min(best.get(key, sec), sec)
        wrong = 0
        if args.check:
            fresh = [dt.from_float64(_values(count, comm.rank), dtype) for _ in range(8)]
            comm.grouped_allreduce(fresh)
            exp = sum(_values(count, k) for k in range(comm.size))
            wrong = sum(_wrong(dt.to_float64(a), exp) for a in fresh)
        factor = BUSBW_FACTOR["grouped"](comm.size) if comm.size > 1 else 0.0
        rows.append({
            "op": "grouped", "size": count * dtype.itemsize, "count": count,
            "tensors": args.tensors, "type": dname, "nranks": comm.size,
            "fused_time_us": best["fused"] * 1e6, "separate_time_us": best["separate"] * 1e6,
            "fused_busbw": total / best["fused"] / 1e9 * factor,
            "speedup": best["separate"] / best["fused"], "wrong": wrong})
        if "raw_separate" in best:
            rows[-1]["raw_separate_time_us"] = best["raw_separate"] * 1e6
            rows[-1]["raw_speedup"] = best["raw_separate"] / best["fused"]
        if "memcpy" in best:
            # The allreduce's memory bound for the whole group (the accounting of --bound),
            # and the fusion ratio a fused call at that bound would reach: the most
            # fusion can give once separate calls are this fast.
            n = comm.size
            bound = (2 + (n - 1) / n) * total / (2 * total / best["memcpy"])
            rows[-1]["bound_us"] = bound * 1e6
            rows[-1]["bound_frac"] = bound / best["fused"]
            rows[-1]["speedup_at_bound"] = best["separate"] / bound
    return rows


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
    from . import comm as comm_mod
    comm = comm_mod.world() if args.path is None else comm_mod.Comm(path=args.path)
    timer = Timer(comm)
    # One handoff between cores, measured now: small-size times follow it (median of 3).
    handoff = sorted(comm.shm_barrier_ns(2000) or 0.0 for _ in range(3))[1] or None
    ops = list(COLLECTIVES) if args.op == "all" else [args.op]
    sections = []
    for op in ops:
        rows = run_grouped(comm, args, timer) if op == "grouped" else \
            run_collective(comm, args, op, timer)
        sections.append(rows)
    handoff_end = sorted(comm.shm_barrier_ns(2000) or 0.0 for _ in range(3))[1] or None
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
