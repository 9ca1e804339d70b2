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


class _Case:
    """One (op, size) of the benchmark on this rank: element type and counts, MPI handles."""

    def __init__(self, comm, op: str, nbytes: int, dname: str, redop: str, root: int) -> None:
        import numpy as np

        from . import dtypes as dt
        self.dt, self.comm, self.redop, self.root = dt, comm, redop, root
        self.dtype = dt.BFLOAT16 if dname == "bfloat16" else np.dtype(dname)
        self.size, self.rank = comm.size, comm.rank
        count = nbytes // self.dtype.itemsize
        split = op in ("allgather", "reduce_scatter", "alltoall")
        if split:
            count -= count % self.size
        self.count, self.per = count, count // self.size if split else count
        self.t = dt.mpi_type(self.dtype)
        self.mop = dt.mpi_op(self.dtype, redop) if op in _REDUCING else None

    def mk(self, n: int, shift: int = 0):
        """``_values(n, shift)`` in the benchmark's dtype."""
        return self.dt.from_float64(_values(n, shift), self.dtype)

    def wrong(self, got, expected) -> int:
        return _wrong(self.dt.to_float64(got), expected)


_REDUCING = ("allreduce", "reduce_scatter", "reduce")
# The collectives whose MPI form is (send, recv[, op]): Comm's method, MPI's, and the
# elements of the input, the output and the in-place buffer ("count", or "per": count/size).
_SEND_RECV = {
    "allreduce": ("allreduce", "Allreduce", "count", "count", "out"),
    "allgather": ("allgather", "Allgather", "per", "count", "out"),
    "reduce_scatter": ("reduce_scatter", "Reduce_scatter_block", "count", "per", "in"),
    "alltoall": ("alltoall", "Alltoall", "count", "count", "out"),
}


def _send_recv_calls(c: _Case, op: str) -> dict:
    """Ours and raw mpi4py's calls, out-of-place and in-place, for an op of _SEND_RECV."""
    import numpy as np
    from ._mpi import MPI
    method, mpi_method, n_in, n_out, inplace = _SEND_RECV[op]
    x, y = c.mk(getattr(c, n_in), c.rank), np.empty(getattr(c, n_out), c.dtype)
    z = x if inplace == "in" else y
    ours, raw, t = getattr(c.comm, method), getattr(c.comm.mpi, mpi_method), c.t
    red, mred = ((c.redop,), (c.mop,)) if c.mop is not None else ((), ())
    return {"ours_oop": lambda: ours(x, *red, out=y),
            "ours_ip": lambda: ours(z, *red, inplace=True),
            "raw_oop": lambda: raw([x, t], [y, t], *mred),
            "raw_ip": lambda: raw(MPI.IN_PLACE, [z, t], *mred)}


def _reduce_calls(c: _Case) -> dict:
    import numpy as np
    from ._mpi import MPI
    comm, m, t, root = c.comm, c.comm.mpi, c.t, c.root
    x, y = c.mk(c.count, c.rank), np.empty(c.count, c.dtype)
    is_root = c.rank == root
    return {"ours_oop": lambda: comm.reduce(x, c.redop, root, out=y if is_root else None),
            "ours_ip": lambda: comm.reduce(y, c.redop, root, inplace=True),
            "raw_oop": lambda: m.Reduce([x, t], [y, t] if is_root else None, c.mop, root),
            "raw_ip": lambda: m.Reduce(MPI.IN_PLACE if is_root else [y, t],
                                       [y, t] if is_root else None, c.mop, root)}


def _broadcast_calls(c: _Case) -> dict:
    import numpy as np
    comm, m, t, root = c.comm, c.comm.mpi, c.t, c.root
    x, y = c.mk(c.count, c.rank), np.empty(c.count, c.dtype)
    return {"ours_oop": lambda: comm.broadcast(x, root, out=y),
            "ours_ip": lambda: comm.broadcast(y, root, inplace=True),
            "raw_oop": lambda: m.Bcast([y, t], root),  # MPI has no out-of-place form
            "raw_ip": lambda: m.Bcast([y, t], root)}


# -- the checked runs: wrong elements on this rank, out-of-place or in place
def _check_allreduce(c: _Case, inplace: bool) -> int:
    import numpy as np
    if inplace:
        got = c.comm.allreduce(c.mk(c.count, c.rank), c.redop, inplace=True)
    else:
        got = c.comm.allreduce(c.mk(c.count, c.rank), c.redop, out=np.empty(c.count, c.dtype))
    return c.wrong(got, _expected_reduce(c.size, c.count, 0, c.redop))


def _check_reduce(c: _Case, inplace: bool) -> int:
    got = c.comm.reduce(c.mk(c.count, c.rank), c.redop, c.root, inplace=inplace)
    if c.rank != c.root:
        return 0
    return c.wrong(got, _expected_reduce(c.size, c.count, 0, c.redop))


def _check_broadcast(c: _Case, inplace: bool) -> int:
    got = c.comm.broadcast(c.mk(c.count, c.rank), c.root, inplace=inplace)
    return c.wrong(got, _values(c.count, c.root))


def _check_allgather(c: _Case, inplace: bool) -> int:
    import numpy as np
    per, rank = c.per, c.rank
    if inplace:
        z = np.zeros(c.count, c.dtype)
        z[rank * per:(rank + 1) * per] = c.mk(per, rank)
        got = c.comm.allgather(z, inplace=True)
    else:
        got = c.comm.allgather(c.mk(per, rank))
    return c.wrong(got, np.concatenate([_values(per, k) for k in range(c.size)]))


def _check_reduce_scatter(c: _Case, inplace: bool) -> int:
    got = c.comm.reduce_scatter(c.mk(c.count, c.rank), c.redop, inplace=inplace)
    full = _expected_reduce(c.size, c.count, 0, c.redop)
    return c.wrong(got, full[c.rank * c.per:(c.rank + 1) * c.per])


def _check_alltoall(c: _Case, inplace: bool) -> int:
    import numpy as np
    per, size, rank = c.per, c.size, c.rank
    src = c.dt.from_float64(np.concatenate([_values(per, 100 * rank + j) for j in range(size)]),
                            c.dtype)
    got = c.comm.alltoall(src, inplace=inplace)
    return c.wrong(got, np.concatenate([_values(per, 100 * j + rank) for j in range(size)]))


# op -> (its four timed calls, its check)
_OPS: dict[str, tuple[Callable[[_Case], dict], Callable[[_Case, bool], int]]] = {
    "allreduce": (lambda c: _send_recv_calls(c, "allreduce"), _check_allreduce),
    "reduce": (_reduce_calls, _check_reduce),
    "broadcast": (_broadcast_calls, _check_broadcast),
    "allgather": (lambda c: _send_recv_calls(c, "allgather"), _check_allgather),
    "reduce_scatter": (lambda c: _send_recv_calls(c, "reduce_scatter"), _check_reduce_scatter),
    "alltoall": (lambda c: _send_recv_calls(c, "alltoall"), _check_alltoall),
}


def build(comm, op: str, nbytes: int, dname: str, redop: str, root: int) -> dict:
    """Buffers and callables for one (op, size): ours and raw, out-of-place and in-place,
    plus a checker returning the number of wrong elements on this rank."""
    if op not in _OPS:
        raise ValueError(op)
    calls, check = _OPS[op]
    c = _Case(comm, op, nbytes, dname, redop, root)
    b: dict[str, Any] = {"count": c.count, "nbytes": c.count * c.dtype.itemsize}
    b.update(calls(c))
    b["check"] = lambda inplace: check(c, inplace)
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


def _time_rounds(timer: Timer, fns: list[tuple[str, Callable[[], Any]]], args,
                 alternate: bool) -> dict[str, list[float]]:
    """Each (key, fn)'s time per round, over ``--rounds`` rounds; ``alternate``: every
    other round runs them in the reverse order."""
    took: dict[str, list[float]] = {}
    for rnd in range(max(1, args.rounds)):
        for key, fn in (fns if not alternate or rnd % 2 == 0 else fns[::-1]):
            sec = timer(fn, max(1, args.warmup_iters), args.iters, args.min_time)
            took.setdefault(key, []).append(sec)
    return took


def _bound_columns(row: dict, best: dict[str, float], nbytes: int, n: int) -> None:
    """--bound: memcpy's rate and the fraction of the memory bound each variant reaches."""
    # Traffic per rank under the accounting above, at memcpy's rate (2N per copy).
    need = (2 + (n - 1) / n) * nbytes
    rate = 2 * nbytes / best["memcpy"]
    row["memcpy_GBps"] = nbytes / best["memcpy"] / 1e9
    row["bound_us"] = need / rate * 1e6
    for v in ("oop", "ip"):
        row[f"{v}_bound_frac"] = row["bound_us"] / (best[f"ours_{v}"] * 1e6)
        if f"raw_{v}" in best:  # raw MPI's own fraction: how close it is already
            row[f"raw_{v}_bound_frac"] = row["bound_us"] / (best[f"raw_{v}"] * 1e6)


def _variant_columns(row: dict, best: dict[str, float], variant: str, nbytes: int,
                     factor: float, wrong: int, baseline: bool) -> None:
    """Time, algbw and busbw of ours (and raw's) for ``variant`` (oop or ip), #wrong, ratio."""
    for who in ("ours", "raw"):
        key = f"{who}_{variant}"
        if key not in best:
            continue
        sec = best[key]
        algbw = nbytes / sec / 1e9 if sec > 0 else 0.0
        prefix = "" if who == "ours" else "raw_"
        row[f"{prefix}{variant}_time_us"] = sec * 1e6
        row[f"{prefix}{variant}_algbw"] = algbw
        row[f"{prefix}{variant}_busbw"] = algbw * factor
    row[f"{variant}_wrong"] = wrong
    if baseline:
        raw = row.get(f"raw_{variant}_time_us", 0.0)
        ours = row.get(f"{variant}_time_us", 0.0)
        row[f"{variant}_ratio"] = raw / ours if ours > 0 else 0.0


def _count_wrong(comm, check: Callable[[bool], int], inplace: bool) -> int:
    """Wrong elements over all ranks in one checked run."""
    import numpy as np
    from ._mpi import MPI
    w = np.array([check(inplace)], dtype=np.int64)
    comm.mpi.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)
    return int(w[0])


def run_collective(comm, args, op: str, timer: Timer) -> list[dict]:
    import numpy as np
    dname = DTYPE_NAMES[args.datatype]
    rows = []
    n = comm.size
    for nbytes in sizes(args):
        redop = args.redop if op in _REDUCING else "none"
        if redop == "avg" and dname.startswith("int"):
            redop = "sum"
        b = build(comm, op, nbytes, dname, redop if redop != "none" else "sum", args.root)
        row: dict[str, Any] = {
            "op": op, "size": b["nbytes"], "count": b["count"], "type": dname, "redop": redop,
            "root": args.root if op in ("broadcast", "reduce") else -1, "nranks": n}
        keys = ["ours_oop", "raw_oop", "ours_ip", "raw_ip"]
        if args.bound and op == "allreduce":
            src, dst = np.ones(b["nbytes"], np.uint8), np.zeros(b["nbytes"], np.uint8)
            b["memcpy"] = lambda: np.copyto(dst, src)
            keys.append("memcpy")
        fns = [(k, b[k]) for k in keys if args.baseline or not k.startswith("raw")]
        took = _time_rounds(timer, fns, args, alternate=True)
        best = {k: (min(v) if args.stat == "best" else float(np.median(v))) for k, v in took.items()}
        if op == "allreduce":
            row["oop_path"] = comm.allreduce_path(b["nbytes"])
            row["ip_path"] = comm.allreduce_path(b["nbytes"], inplace=True)
        if "memcpy" in best and b["nbytes"]:
            _bound_columns(row, best, b["nbytes"], n)
        factor = BUSBW_FACTOR[op](n) if n > 1 else 0.0
        for variant in ("oop", "ip"):
            wrong = _count_wrong(comm, b["check"], variant == "ip") if args.check else -1
            _variant_columns(row, best, variant, b["nbytes"], factor, wrong, args.baseline)
        rows.append(row)
    return rows


def _grouped_fns(comm, args, arrays: list, dtype, total: int) -> list[tuple[str, Callable]]:
    """The timed calls of -o grouped: fused, separate, and raw MPI's separate (--baseline)
    and memcpy of the group's bytes (--bound)."""
    import numpy as np

    from . import dtypes as dt

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
    if args.bound:
        # memcpy of the whole group's bytes on every rank at once (see --bound).
        src, dst = np.ones(total, np.uint8), np.zeros(total, np.uint8)
        fns.append(("memcpy", lambda: np.copyto(dst, src)))
    return fns


def _grouped_wrong(comm, count: int, dtype) -> int:
    """Wrong elements on this rank after one grouped_allreduce of 8 fresh arrays."""
    from . import dtypes as dt
    fresh = [dt.from_float64(_values(count, comm.rank), dtype) for _ in range(8)]
    comm.grouped_allreduce(fresh)
    exp = sum(_values(count, k) for k in range(comm.size))
    return sum(_wrong(dt.to_float64(a), exp) for a in fresh)


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
        total = count * dtype.itemsize * args.tensors
        fns = _grouped_fns(comm, args, arrays, dtype, total)
        best = {k: min(v) for k, v in _time_rounds(timer, fns, args, alternate=False).items()}
        wrong = _grouped_wrong(comm, count, dtype) if args.check else 0
        factor = BUSBW_FACTOR["grouped"](comm.size) if comm.size > 1 else 0.0
        row = {
            "op": "grouped", "size": count * dtype.itemsize, "count": count,
            "tensors": args.tensors, "type": dname, "nranks": comm.size,
            "fused_time_us": best["fused"] * 1e6, "separate_time_us": best["separate"] * 1e6,
            "fused_busbw": total / best["fused"] / 1e9 * factor,
            "speedup": best["separate"] / best["fused"], "wrong": wrong}
        if "raw_separate" in best:
            row["raw_separate_time_us"] = best["raw_separate"] * 1e6
            row["raw_speedup"] = best["raw_separate"] / best["fused"]
        if "memcpy" in best:
            # The allreduce's memory bound for the whole group (the accounting of --bound),
            # and the fusion ratio a fused call at that bound would reach: the most
            # fusion can give once separate calls are this fast.
            n = comm.size
            bound = (2 + (n - 1) / n) * total / (2 * total / best["memcpy"])
            row.update(bound_us=bound * 1e6, bound_frac=bound / best["fused"],
                       speedup_at_bound=best["separate"] / bound)
        rows.append(row)
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
