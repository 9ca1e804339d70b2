"""The measured part of ``collectives.bench``: buffers, calls, the timer and the checked runs.

Per (collective, size): ours and raw mpi4py's calls on the same buffers, out of place
and in place; the timer (the slowest rank's mean per iteration); the checked runs that
count wrong elements with exact small-integer inputs; and the rows of figures the
table and the JSON print. Separate from ``bench`` because it needs NumPy and MPI, and
the dtrun command imports ``bench`` for its argument parser alone.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import comm as comm_mod
from . import dtypes as dt
from ._mpi import MPI

BUSBW_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "grouped": lambda n: 2 * (n - 1) / n,
}


class Timer:
    """Mean time per iteration, max over ranks (MPI.Wtime, barrier first)."""

    def __init__(self, comm) -> None:
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
    return ((np.arange(n) + shift) % 3 + 1).astype(np.float64)


class _Case:
    """One (op, size) of the benchmark on this rank: element type and counts, MPI handles."""

    def __init__(self, comm, op: str, nbytes: int, dname: str, redop: str, root: int) -> None:
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
    comm, m, t, root = c.comm, c.comm.mpi, c.t, c.root
    x, y = c.mk(c.count, c.rank), np.empty(c.count, c.dtype)
    is_root = c.rank == root
    return {"ours_oop": lambda: comm.reduce(x, c.redop, root, out=y if is_root else None),
            "ours_ip": lambda: comm.reduce(y, c.redop, root, inplace=True),
            "raw_oop": lambda: m.Reduce([x, t], [y, t] if is_root else None, c.mop, root),
            "raw_ip": lambda: m.Reduce(MPI.IN_PLACE if is_root else [y, t],
                                       [y, t] if is_root else None, c.mop, root)}


def _broadcast_calls(c: _Case) -> dict:
    comm, m, t, root = c.comm, c.comm.mpi, c.t, c.root
    x, y = c.mk(c.count, c.rank), np.empty(c.count, c.dtype)
    return {"ours_oop": lambda: comm.broadcast(x, root, out=y),
            "ours_ip": lambda: comm.broadcast(y, root, inplace=True),
            "raw_oop": lambda: m.Bcast([y, t], root),  # MPI has no out-of-place form
            "raw_ip": lambda: m.Bcast([y, t], root)}


# -- the checked runs: wrong elements on this rank, out-of-place or in place
def _check_allreduce(c: _Case, inplace: bool) -> int:
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
    vals = [_values(count, shift + k) for k in range(size)]
    if redop == "sum":
        return sum(vals)
    if redop == "avg":
        return sum(vals) / size
    if redop == "prod":
        return np.prod(vals, axis=0)
    return (np.min if redop == "min" else np.max)(vals, axis=0)


def _wrong(got, expected) -> int:
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
    w = np.array([check(inplace)], dtype=np.int64)
    comm.mpi.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)
    return int(w[0])


def run_collective(comm, args, op: str, timer: Timer, dname: str,
                   size_list: list[int]) -> list[dict]:
    """One row per size of collective ``op`` on dtype ``dname``: ours (and raw mpi4py's)."""
    rows = []
    n = comm.size
    for nbytes in size_list:
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

    def separate():
        for a in arrays:
            comm.allreduce(a, inplace=True)
    fused = lambda: comm.grouped_allreduce(arrays)  # noqa: E731
    fns = [("fused", fused), ("separate", separate)]
    if args.baseline:
        # What a user without dtrun writes: one MPI_Allreduce in place per array.
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
    fresh = [dt.from_float64(_values(count, comm.rank), dtype) for _ in range(8)]
    comm.grouped_allreduce(fresh)
    exp = sum(_values(count, k) for k in range(comm.size))
    return sum(_wrong(dt.to_float64(a), exp) for a in fresh)


def run_grouped(comm, args, timer: Timer, dname: str, size_list: list[int]) -> list[dict]:
    """Fusion: grouped_allreduce of --tensors arrays vs one allreduce per array."""
    dtype = dt.BFLOAT16 if dname == "bfloat16" else np.dtype(dname)
    rows = []
    for nbytes in size_list:
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


def measure(args, ops: list[str], dname: str, size_list: list[int]):
    """Every collective of ``ops`` at each size of ``size_list``, on dtype ``dname``:
    (the communicator, one list of rows per collective, the shared-memory barrier's
    nanoseconds before and after)."""
    comm = comm_mod.world() if args.path is None else comm_mod.Comm(path=args.path)
    timer = Timer(comm)
    # One handoff between cores, measured now: small-size times follow it (median of 3).
    handoff = sorted(comm.shm_barrier_ns(2000) or 0.0 for _ in range(3))[1] or None
    sections = []
    for op in ops:
        rows = run_grouped(comm, args, timer, dname, size_list) if op == "grouped" else \
            run_collective(comm, args, op, timer, dname, size_list)
        sections.append(rows)
    handoff_end = sorted(comm.shm_barrier_ns(2000) or 0.0 for _ in range(3))[1] or None
    return comm, sections, handoff, handoff_end
