"""The checks of ``collectives.smoke``: inputs, expected values, the runs and the watchdog.

For each operation, dtype and size: this rank's input (small integers, exact in every
dtype), the expected result, the run under a watchdog that aborts the job when a
collective hangs, and the bit-for-bit comparison; then every rank's report gathered on
rank 0. Separate from ``smoke`` because it needs NumPy and MPI, and the dtrun command
imports ``smoke`` for its argument parser alone.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from . import comm as comm_mod
from . import dtypes as dt
from ._mpi import MPI
from .array_kinds import numpy_to_torch


def _inject(var: str) -> tuple[str, int] | None:
    raw = os.environ.get(var, "")
    if ":" not in raw:
        return None
    op, rank = raw.split(":", 1)
    return op.strip(), int(rank)


class Watchdog(threading.Thread):
    """Aborts the job when the armed collective runs past its deadline."""

    def __init__(self, timeout: float, rank: int, host: str, exit_code: int) -> None:
        super().__init__(daemon=True, name="smoke-watchdog")
        self.timeout, self.rank, self.host = timeout, rank, host
        self.exit_code = exit_code  # smoke's HANG
        self.label: str | None = None
        self.deadline = 0.0

    def arm(self, label: str) -> None:
        self.label, self.deadline = label, time.monotonic() + self.timeout

    def disarm(self) -> None:
        self.label = None

    def run(self) -> None:
        while True:
            time.sleep(min(0.1, self.timeout / 10))
            label = self.label
            if label is not None and time.monotonic() > self.deadline:
                print(f"HANG: {label} did not complete within {self.timeout:g} s on rank "
                      f"{self.rank} ({self.host}); a rank never entered it or the network "
                      "stalls — check that all ranks run the same program", flush=True)
                sys.stderr.flush()
                try:
                    MPI.COMM_WORLD.Abort(self.exit_code)
                finally:
                    os._exit(self.exit_code)


class Arrays:
    """Makes test inputs in the chosen array library and reads results back."""

    def __init__(self, device: str) -> None:
        self.dt = dt
        self.device = device
        self.lib = "numpy"
        if device == "cuda":
            from . import gpu  # lazy: the GPU package, only for --device cuda
            gpu.select_device()
            try:
                import torch  # noqa: F401
                self.lib = "torch"
            except ImportError:
                self.lib = "cupy"

    def dtype(self, name: str):
        return self.dt.BFLOAT16 if name == "bfloat16" else np.dtype(name)

    def make(self, values, name: str):
        a = self.dt.from_float64(values, self.dtype(name))
        if self.lib == "torch":
            return numpy_to_torch(a).to("cuda")
        if self.lib == "cupy":
            import cupy
            return cupy.asarray(a)
        return a

    def read(self, a):
        if a is None:
            return None
        if self.lib == "torch":
            import torch
            t = a.detach().cpu()
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)
                return self.dt.to_float64(t.numpy().view(self.dt.BFLOAT16))
            return t.numpy().astype(np.float64)
        if self.lib == "cupy":
            import cupy
            return cupy.asnumpy(a).astype(np.float64)
        return self.dt.to_float64(np.asarray(a))


def _pattern(n: int, shift: int):
    return ((np.arange(n) + shift) % 3 + 1).astype(np.float64)


class _Inputs:
    """One (dtype, size) of the smoke test on this rank: inputs and expected blocks."""

    def __init__(self, comm, A: Arrays, dname: str, n: int) -> None:
        self.comm, self.A, self.dname, self.n = comm, A, dname, n
        self.size, self.rank = comm.size, comm.rank

    def x(self):
        """This rank's input: ``_pattern(n, rank)``."""
        return self.A.make(_pattern(self.n, self.rank), self.dname)

    def make(self, values):
        return self.A.make(values, self.dname)

    def blocks(self, f: Callable[[int], Any]):
        """``f(k)`` for every rank k, concatenated (float64)."""
        return np.concatenate([f(k) for k in range(self.size)]) if self.size else None

    def total(self, m: int | None = None):
        """The sum over ranks of their ``_pattern(m, rank)`` (m: n by default)."""
        m = self.n if m is None else m
        return sum(_pattern(m, k) for k in range(self.size))


Case = tuple[str, Callable[[], Any], Any]  # (variant, run() -> result, expected float64 or None)


def _sendrecv(c: _Inputs) -> list[Case]:
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    return [("ring", lambda: c.comm.sendrecv(c.x(), right, c.make(np.zeros(c.n)), left),
             _pattern(c.n, left))]


def _broadcast(c: _Inputs) -> list[Case]:
    root = c.size - 1
    return [("out", lambda: c.comm.broadcast(c.x(), root=root), _pattern(c.n, root)),
            ("inplace", lambda: c.comm.broadcast(c.x(), root=0, inplace=True), _pattern(c.n, 0))]


def _scatter(c: _Inputs) -> list[Case]:
    full = lambda: c.make(c.blocks(lambda k: _pattern(c.n, 10 * k)))  # noqa: E731
    return [("out", lambda: c.comm.scatter(full(), root=0), _pattern(c.n, 10 * c.rank))]


def _gather(c: _Inputs) -> list[Case]:
    root = c.size - 1
    exp = c.blocks(lambda k: _pattern(c.n, k)) if c.rank == root else None
    return [("out", lambda: c.comm.gather(c.x(), root=root), exp)]


def _reduce(c: _Inputs) -> list[Case]:
    exp = c.total() if c.rank == 0 else None
    return [("sum", lambda: c.comm.reduce(c.x(), op="sum", root=0), exp)]


def _allreduce(c: _Inputs) -> list[Case]:
    comm, n, size = c.comm, c.n, c.size
    mm = lambda k: ((np.arange(n) + k) % size).astype(np.float64)  # noqa: E731
    two = lambda: c.make(1.0 + (mm(c.rank) == 0))  # noqa: E731 one 2 per element
    cases: list[Case] = [
        ("sum", lambda: comm.allreduce(c.x()), c.total()),
        ("sum-inplace", lambda: comm.allreduce(c.x(), inplace=True), c.total()),
        ("min", lambda: comm.allreduce(c.make(mm(c.rank)), op="min"), np.zeros(n)),
        ("max", lambda: comm.allreduce(c.make(mm(c.rank)), op="max"), np.full(n, size - 1.0)),
        ("prod", lambda: comm.allreduce(two(), op="prod"), np.full(n, 2.0))]
    if c.dname.startswith(("float", "bfloat")):
        cases.append(("avg", lambda: comm.allreduce(c.make(np.full(n, float(c.rank))), op="avg"),
                      np.full(n, (size - 1) / 2)))
    return cases


def _allgather(c: _Inputs) -> list[Case]:
    return [("out", lambda: c.comm.allgather(c.x()), c.blocks(lambda k: _pattern(c.n, k)))]


def _allgatherv(c: _Inputs) -> list[Case]:
    mine = lambda: c.make(_pattern(c.n + c.rank, c.rank))  # noqa: E731
    return [("v", lambda: c.comm.allgatherv(mine()), c.blocks(lambda k: _pattern(c.n + k, k)))]


def _reduce_scatter(c: _Inputs) -> list[Case]:
    full = lambda: c.make(c.blocks(lambda k: _pattern(c.n, k + c.rank)))  # noqa: E731
    return [("sum", lambda: c.comm.reduce_scatter(full()),
             sum(_pattern(c.n, c.rank + k) for k in range(c.size)))]


def _alltoall(c: _Inputs) -> list[Case]:
    # Rank r sends block j = pattern(n, 100r + j); receives block j = pattern(n, 100j + r).
    full = lambda: c.make(c.blocks(lambda j: _pattern(c.n, 100 * c.rank + j)))  # noqa: E731
    return [("out", lambda: c.comm.alltoall(full()),
             c.blocks(lambda j: _pattern(c.n, 100 * j + c.rank)))]


def _iallreduce(c: _Inputs) -> list[Case]:
    return [("sum", lambda: c.comm.iallreduce(c.x()).wait(), c.total())]


def _grouped(c: _Inputs) -> list[Case]:
    sizes = (c.n, 1, c.n + 5)

    def run():
        arrs = [c.make(_pattern(m, c.rank)) for m in sizes]
        c.comm.grouped_allreduce(arrs, fusion_threshold=4096)
        return arrs
    return [("fused", run, np.concatenate([c.total(m) for m in sizes]))]


# The checks of each op (every name in OPS).
CASES: dict[str, Callable[[_Inputs], list[Case]]] = {
    "sendrecv": _sendrecv, "broadcast": _broadcast, "scatter": _scatter, "gather": _gather,
    "reduce": _reduce, "allreduce": _allreduce, "allgather": _allgather,
    "allgatherv": _allgatherv, "reduce_scatter": _reduce_scatter, "alltoall": _alltoall,
    "iallreduce": _iallreduce, "grouped": _grouped,
}


def _cases(comm, A: Arrays, op: str, dname: str, n: int) -> list[Case]:
    """(variant, run() -> result, expected float64 array or None) for one op."""
    return CASES[op](_Inputs(comm, A, dname, n))


def run_checks(comm, A: Arrays, args, watchdog: Watchdog) -> dict[str, dict]:
    """Run every selected op; return {op: {"ok": bool, "detail": str, "checks": int}}."""
    err_inject = _inject("DTRUN_SMOKE_INJECT_ERROR")
    hang_inject = _inject("DTRUN_SMOKE_INJECT_HANG")
    results: dict[str, dict] = {}
    for op in args.ops:
        entry = {"ok": True, "detail": "", "checks": 0}
        results[op] = entry
        for dname in args.dtypes:
            for n in args.sizes:
                for variant, run, expected in _cases(comm, A, op, dname, n):
                    label = f"{op} {dname} n={n}" + (f" ({variant})" if variant else "")
                    if hang_inject == (op, comm.rank):
                        print(f"[test hook] rank {comm.rank} skips {label}", flush=True)
                        while True:  # never enter the collective
                            time.sleep(1)
                    watchdog.arm(label)
                    try:
                        result = run()
                        if isinstance(result, list):
                            got = np.concatenate([A.read(r).reshape(-1) for r in result])
                        else:
                            got = A.read(result)
                    except Exception as e:  # report, keep the table complete
                        watchdog.disarm()
                        if entry["ok"]:
                            entry.update(ok=False, detail=f"{label}: {type(e).__name__}: {e}")
                        continue
                    watchdog.disarm()
                    entry["checks"] += 1
                    if got is not None and err_inject == (op, comm.rank) and got.size:
                        got = got.copy()
                        got.reshape(-1)[0] += 1  # test hook: one wrong value
                    problem = _compare(got, expected)
                    if problem and entry["ok"]:
                        entry.update(ok=False, detail=f"{label}: {problem}")
    return results


def _compare(got, expected) -> str | None:
    if expected is None:
        return None if got is None else "expected no result on this rank"
    if got is None:
        return "no result"
    got = np.asarray(got).reshape(-1)
    expected = np.asarray(expected, dtype=np.float64).reshape(-1)
    if got.shape != expected.shape:
        return f"got {got.size} elements, expected {expected.size}"
    bad = np.flatnonzero(got != expected)
    if bad.size:
        i = int(bad[0])
        return f"{bad.size} wrong values, first at [{i}]: got {got[i]:g}, expected {expected[i]:g}"
    return None


def _open_device(comm, args, watchdog: Watchdog) -> tuple[Arrays, str] | None:
    """The arrays of ``--device`` and the device's description for the table; None, with
    the reason on stderr, when it cannot be used."""
    device = "cpu"
    try:
        watchdog.arm(f"setting up --device {args.device}")
        A = Arrays(args.device)
        if args.device == "cuda":
            from . import gpu  # lazy: the GPU package, only for --device cuda
            # Collective the first time (all ranks agree on NCCL); shows the path taken.
            path = gpu.gpu_path(comm, "allreduce", A.make(np.ones(1), "float32"), "sum")
            device = f"{gpu.describe_device()} [{path}]"
        watchdog.disarm()
    except Exception as e:
        print(f"smoke: rank {comm.rank} ({comm.host}): cannot use --device {args.device}: {e}",
              file=sys.stderr, flush=True)
        return None
    return A, device


def run(args, hang_exit: int) -> tuple[Any, list[dict] | None, bool | None]:
    """Every check of ``args`` on this rank, then every rank's report on rank 0:
    (the communicator, the reports on rank 0 else None, whether all ranks passed; None
    when the device cannot be used). A hang exits the job with ``hang_exit``."""
    comm = comm_mod.world()
    watchdog = Watchdog(args.timeout, comm.rank, comm.host, hang_exit)
    watchdog.start()
    opened = _open_device(comm, args, watchdog)
    if opened is None:
        return comm, None, None
    A, device = opened
    t0 = time.monotonic()
    results = run_checks(comm, A, args, watchdog)
    mine = {"rank": comm.rank, "host": comm.host, "local_rank": comm.local_rank,
            "node": comm.node, "device": device, "results": results,
            "seconds": round(time.monotonic() - t0, 3)}
    # Gather per-rank reports as JSON bytes with our own gatherv (no pickling).
    watchdog.arm("gathering results")
    blob = np.frombuffer(json.dumps(mine).encode(), dtype=np.uint8)
    gathered = comm.gatherv(blob, root=0)
    ok_all = np.array([all(r["ok"] for r in results.values())], dtype=np.uint8)
    comm.allreduce(ok_all, op="min", inplace=True)
    watchdog.disarm()
    if comm.rank != 0:
        return comm, None, bool(ok_all[0])
    rows, pos = [], 0
    text = bytes(gathered).decode()
    decoder = json.JSONDecoder()
    while pos < len(text):
        row, pos = decoder.raw_decode(text, pos)
        rows.append(row)
    return comm, rows, bool(ok_all[0])
