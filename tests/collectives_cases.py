"""Collective test cases, written once and run at any size: one rank under plain pytest, several under mpirun.

Each ``case_*`` function takes a ``collectives.Comm`` and raises on failure (or
``Skip``). ``tests/test_collectives.py`` runs them in the pytest process on a
one-rank COMM_WORLD, and launches this module under dtrun with 2 and 3 ranks:

    dtrun -np 3 python -m tests.collectives_cases [--only NAME,...]

which runs every case on COMM_WORLD and prints one ``CASES {json}`` line per rank
(passed / failed with traceback / skipped). Assertions come after the collectives
they check, so a failing rank never leaves the others waiting; a watchdog aborts
the job if a case hangs anyway.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

import numpy as np

from dtrun import collectives
from dtrun.collectives import (CollectiveError, MismatchError, NotContiguousError, ShapeError,
                         UnsupportedDtypeError)


class Skip(Exception):
    """This case does not apply here (reason in the message)."""


def _pat(n, shift=0, dtype=np.float64):
    return ((np.arange(n) + shift) % 5 + 1).astype(dtype)


def _total(comm, n, dtype=np.float64):
    return sum(_pat(n, k) for k in range(comm.size)).astype(dtype)


def _same_everywhere(comm, a: np.ndarray) -> bool:
    """True if ``a`` has identical bytes on every rank."""
    raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    everyone = comm.allgather(raw)
    return all(np.array_equal(everyone[k * raw.size:(k + 1) * raw.size], raw)
               for k in range(comm.size))


def _raises(exc_type, fn, *needles):
    """Call fn; it must raise exc_type whose message contains every needle."""
    try:
        fn()
    except exc_type as e:
        msg = str(e)
        for needle in needles:
            assert needle in msg, f"{needle!r} not in message {msg!r}"
        return e
    raise AssertionError(f"expected {exc_type.__name__}")


# ----------------------------------------------------------------------------- cases
def case_rank_info(comm):
    info = np.array([comm.rank, comm.local_rank, comm.local_size, comm.node, comm.nnodes])
    table = comm.allgather(info.reshape(1, -1))
    assert table.shape == (comm.size, 5)
    assert list(table[:, 0]) == list(range(comm.size))
    assert comm.nnodes == len(set(table[:, 3].tolist()))
    for node in set(table[:, 3].tolist()):
        members = table[table[:, 3] == node]
        assert sorted(members[:, 1].tolist()) == list(range(len(members)))
        assert (members[:, 2] == len(members)).all()
    assert 0 <= comm.local_rank < comm.local_size <= comm.size


def case_allreduce_ops(comm):
    n, size = 37, comm.size
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16):
        x = _pat(n, comm.rank, dtype)
        np.testing.assert_array_equal(comm.allreduce(x), _total(comm, n, dtype))
        np.testing.assert_array_equal(comm.allreduce(x, op="max"),
                                      np.max([_pat(n, k) for k in range(size)], 0).astype(dtype))
        np.testing.assert_array_equal(comm.allreduce(x, op=collectives.MIN),
                                      np.min([_pat(n, k) for k in range(size)], 0).astype(dtype))
        ones = np.ones(n, dtype)
        ones[comm.rank % n] = 2
        expect = np.ones(n)
        for k in range(size):
            expect[k % n] *= 2
        np.testing.assert_array_equal(comm.allreduce(ones, op="prod"), expect.astype(dtype))
        if np.dtype(dtype).kind == "f":
            avg = comm.allreduce(np.full(n, comm.rank, dtype), op="avg")
            np.testing.assert_array_equal(avg, np.full(n, (size - 1) / 2, dtype))


def case_allreduce_forms(comm):
    """New array, out=, inplace=True, out=x; multi-dimensional; zero and one element."""
    for shape in [(0,), (1,), (3, 5), (2, 3, 4)]:
        n = int(np.prod(shape))
        x = _pat(n, comm.rank, np.float32).reshape(shape)
        keep = x.copy()
        expect = _total(comm, n, np.float32).reshape(shape)
        y = comm.allreduce(x)
        assert y is not x and y.shape == shape
        np.testing.assert_array_equal(y, expect)
        np.testing.assert_array_equal(x, keep)  # input untouched
        out = np.empty(shape, np.float32)
        assert comm.allreduce(x, out=out) is out
        np.testing.assert_array_equal(out, expect)
        z = x.copy()
        assert comm.allreduce(z, inplace=True) is z
        np.testing.assert_array_equal(z, expect)
        w = x.copy()
        assert comm.allreduce(w, out=w) is w
        np.testing.assert_array_equal(w, expect)


def case_allreduce_shm_exact(comm):
    """The shared-memory path (several chunks, odd tail): exact and bitwise identical."""
    sub = collectives.Comm(comm.mpi, shm_threshold=1024, shm_chunk=8192)
    try:
        for dtype in (np.float32, np.float64, np.int64, np.float16):
            n = 70001
            x = _pat(n, comm.rank, dtype)
            expect = _total(comm, n, dtype)
            got = sub.allreduce(x)
            np.testing.assert_array_equal(got, expect)
            inplace = x.copy()
            sub.allreduce(inplace, inplace=True)
            np.testing.assert_array_equal(inplace, expect)
        # Floats that do not add exactly: every rank must still hold the same bits.
        rng = np.random.default_rng(comm.rank)
        f = rng.standard_normal(50000).astype(np.float32)
        got = sub.allreduce(f)
        assert _same_everywhere(comm, got)
        avg = sub.allreduce(f, op="avg")
        assert _same_everywhere(comm, avg)
        for op in ("min", "max", "prod"):
            small = _pat(20000, comm.rank, np.float64)
            r = sub.allreduce(small, op=op)
            full = np.array([_pat(20000, k) for k in range(comm.size)])
            ref = {"min": full.min(0), "max": full.max(0), "prod": full.prod(0)}[op]
            np.testing.assert_array_equal(r, ref)
        if comm.local_size > 1:
            assert sub.allreduce_path(1 << 20).startswith("shm")
    finally:
        sub.free()


def case_hierarchical(comm):
    """Emulated multi-host: nodes of 2 ranks; shm inside, MPI between, or MPI fallback."""
    node_comm = comm.mpi.Split(comm.rank // 2, comm.rank)
    sub = collectives.Comm(comm.mpi, node_comm=node_comm, shm_threshold=1024, shm_chunk=4096)
    try:
        assert sub.nnodes == (comm.size + 1) // 2
        assert sub.node == comm.rank // 2
        if comm.size % 2 == 0 and comm.size > 2:
            assert sub.allreduce_path(1 << 20) == "shm+hierarchical"
        for dtype in (np.float32, np.int64):
            x = _pat(10007, comm.rank, dtype)
            np.testing.assert_array_equal(sub.allreduce(x), _total(comm, 10007, dtype))
        _same_bits_and_grouped(comm, sub, 9000, (300, 5, 2000))
    finally:
        sub.free()


def _same_bits_and_grouped(comm, sub, n_random, grad_sizes):
    """Along ``sub``'s path: a random float64 sum gives the same bits on every rank, and a
    grouped allreduce of ``grad_sizes`` arrays gives exact sums."""
    rng = np.random.default_rng(comm.rank)
    assert _same_everywhere(comm, sub.allreduce(rng.standard_normal(n_random)))
    grads = [_pat(k, comm.rank) for k in grad_sizes]
    sub.grouped_allreduce(grads)
    for g in grads:
        np.testing.assert_array_equal(g, _total(comm, g.size))


def case_hierarchical_paths(comm):
    """Emulated 2-rank hosts, each inter-host path forced in turn (shm+hierarchical,
    shm+ring, ring, mpi): exact sums, the same bits everywhere, grouped too."""
    node_comm = comm.mpi.Split(comm.rank // 2, comm.rank)
    if comm.size % 2 == 0 and comm.size > 2:  # uniform hosts of 2
        paths = ["shm+hierarchical", "shm+ring", "ring", "stream", "mpi"]
    elif comm.size == 2:  # one host
        paths = ["shm", "mpi"]
    else:  # one rank, or hosts of 2 and 1 (no shared-memory step)
        paths = ["ring", "stream", "mpi"] if comm.size > 1 else ["mpi"]
    for path in paths:
        sub = collectives.Comm(comm.mpi, node_comm=node_comm.Dup(), path=path)
        try:
            assert sub.allreduce_path(1 << 20) == path or comm.size == 1
            for dtype, n in ((np.float32, 10007), (np.int64, 3), (np.float64, 200001)):
                x = _pat(n, comm.rank, dtype)
                np.testing.assert_array_equal(sub.allreduce(x), _total(comm, n, dtype))
                sub.allreduce(x, inplace=True)
                np.testing.assert_array_equal(x, _total(comm, n, dtype))
            avg = sub.allreduce(np.full(5000, 2.0 * comm.rank), op="avg")
            np.testing.assert_array_equal(avg, np.full(5000, comm.size - 1.0))
            _same_bits_and_grouped(comm, sub, 70000, (300, 5, 20000))
        finally:
            sub.free()


def case_stream_exact(comm):
    """The streaming TCP ring between emulated hosts of 2 ranks (and 1), forced: sums and
    averages of the dtypes it takes are exact, in place, out of place and out=, from 0
    elements to parts of several chunks, 2-D too; other dtypes (float16, int8) and ops
    (max) take MPI's allreduce, exact; random floats give the same bits everywhere; a count
    that differs between ranks is a MismatchError on every rank, and the calls after it
    are exact."""
    if comm.size < 3:
        raise Skip("needs 2 emulated hosts: 3 or more ranks")
    sub = collectives.Comm(comm.mpi, node_comm=comm.mpi.Split(comm.rank // 2, comm.rank),
                           path="stream")
    try:
        assert sub.nnodes > 1 and sub.allreduce_path(1) == "stream"
        for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16, np.int8):
            for n in (0, 1, 7, 3 * (512 << 10) // np.dtype(dtype).itemsize + 5):
                x, expect = _pat(n, comm.rank, dtype), _total(comm, n, dtype)
                np.testing.assert_array_equal(sub.allreduce(x), expect)
                out = np.empty_like(x)
                assert sub.allreduce(x, out=out) is out
                np.testing.assert_array_equal(out, expect)
                sub.allreduce(x, inplace=True)
                np.testing.assert_array_equal(x, expect)
        assert sub._stream  # opened, and used (float16 and int8 took MPI's allreduce)
        x = _pat(6000, comm.rank, np.float32).reshape(2, 3000)
        np.testing.assert_array_equal(sub.allreduce(x), _total(comm, 6000, np.float32).reshape(2, 3000))
        avg = sub.allreduce(np.full(300001, 2.0 * comm.rank), op="avg")
        np.testing.assert_array_equal(avg, np.full(300001, comm.size - 1.0))
        top = sub.allreduce(np.full(70000, float(comm.rank)), op="max")
        np.testing.assert_array_equal(top, np.full(70000, comm.size - 1.0))
        rng = np.random.default_rng(comm.rank)
        assert _same_everywhere(comm, sub.allreduce(rng.standard_normal(400003)))
        wrong = _pat(1000 + (comm.rank == 0), comm.rank, np.float32)
        _raises(MismatchError, lambda: sub.allreduce(wrong, inplace=True), "allreduce",
                "1000", "1001")
        x = _pat(200001, comm.rank, np.float64)
        np.testing.assert_array_equal(sub.allreduce(x), _total(comm, 200001, np.float64))
    finally:
        sub.free()
    # A malformed DTRUN_DP_RING_PORTS on one rank: ValueError on every rank, before the
    # ring is opened (no rank is left in a collective of its own).
    sub = collectives.Comm(comm.mpi, node_comm=comm.mpi.Split(comm.rank // 2, comm.rank),
                           path="stream")
    try:
        bad = {"DTRUN_DP_RING_PORTS": "80-90"} if comm.rank == comm.size - 1 else {}
        _raises(ValueError, lambda: _with_env(bad, lambda: sub.allreduce(np.ones(10))),
                "DTRUN_DP_RING_PORTS='80-90': expected LOW-HIGH")
        np.testing.assert_array_equal(sub.allreduce(np.ones(10)), np.full(10, comm.size))
    finally:
        sub.free()


def case_shm1_exact(comm):
    """The compiled paths (shm1: one sync per step, every rank reduces all; shm2: two
    syncs, each rank reduces a slice), each forced at every size: every dtype and op the
    runtime reduces (float16/bfloat16/complex through its Python fallback), counts of 0, 1,
    7, 1001 and 3 steps of its slot plus a tail, in place, out of place and out=, exact;
    random floats give the same bits on every rank; what it does not take (a strided array,
    a wrong out, DTRUN_CHECK mode) reaches the Python path and its errors."""
    from dtrun.collectives import dtypes as dt, shm1
    if comm.local_size < 2 or comm.nnodes > 1:
        raise Skip("shm1 needs several ranks on one host and no other host")
    if not shm1.available():
        _raises(ValueError, lambda: collectives.Comm(comm.mpi, path="shm1"), "this layout offers")
        raise Skip(f"the compiled engine is not in use here: {shm1.why_not()}")
    for path in ("shm1", "shm2"):
        _compiled_path_exact(comm, path)


def case_shm_streaming_exact(comm):
    """The compiled paths with every slot written by streaming stores (DTRUN_SHM_NT=1, from
    the first byte): the same exact results as case_shm1_exact, misaligned segments of
    grouped arrays included."""
    from dtrun.collectives import shm1
    if comm.local_size < 2 or comm.nnodes > 1 or not shm1.available():
        raise Skip("needs the compiled engine and several ranks on one host only")
    for path in ("shm1", "shm2"):
        _compiled_path_exact(comm, path, streaming=True)


def case_shm_streaming_choice(comm):
    """DTRUN_SHM_NT=auto: a call of nt_floor bytes or more times synchronisation rounds and
    streams when a round is slower than nt_ns; smaller calls never do; with more ranks
    than CPUs nothing is timed; ranks whose sizes differ across the floor still all raise
    MismatchError, and the engine works after it; DTRUN_SHM_NT is checked."""
    from dtrun.collectives import shm1
    if comm.local_size < 2 or comm.nnodes > 1 or not shm1.available():
        raise Skip("needs the compiled engine and several ranks on one host only")
    _raises(ValueError, lambda: _with_env({"DTRUN_SHM_NT": "sometimes"},
                                          lambda: collectives.Comm(comm.mpi, path="shm2")),
            "DTRUN_SHM_NT='sometimes'", "auto")
    for raw, code in (("0", 0), ("1", 1), ("AUTO", -1)):
        c = _with_env({"DTRUN_SHM_NT": raw}, lambda: collectives.Comm(comm.mpi, path="shm2"))
        assert c._engine.nt_mode == code, (raw, c._engine.nt_mode)
        c.free()
    sub = collectives.Comm(comm.mpi, path="shm2")
    try:
        eng = sub._engine
        big, small = eng.nt_floor // 8, eng.nt_floor // 8 - 1
        assert eng.nt_mode == -1 and eng.nt_floor == 256 << 10
        for inplace in (False, True):
            for ns, streams in ((0, 1), (1 << 40, 0)):
                eng.nt_ns = ns
                calls = eng.nt_calls
                x = _pat(big, comm.rank)
                got = sub.allreduce(x, inplace=inplace)
                np.testing.assert_array_equal(got, _total(comm, big))
                if eng.yield_always:  # more ranks than CPUs: never timed, never streams
                    assert eng.nt_calls == calls and eng.nt_last_ns == 0
                else:
                    assert eng.nt_calls == calls + streams and eng.nt_last_ns > 0
                np.testing.assert_array_equal(sub.allreduce(_pat(small, comm.rank), inplace=inplace),
                                              _total(comm, small))
                assert eng.nt_calls == calls + (0 if eng.yield_always else streams)
        eng.nt_ns = 0
        if comm.size > 1:
            x = _pat(big if comm.rank == 0 else 8, comm.rank)
            _raises(MismatchError, lambda: sub.allreduce(x, inplace=True), "allreduce")
        for n in (big, 5, big * 3 + 7):
            np.testing.assert_array_equal(sub.allreduce(_pat(n, comm.rank)), _total(comm, n))
    finally:
        sub.free()


def _compiled_path_exact(comm, path, streaming=False):
    from dtrun.collectives import dtypes as dt, shm1
    sub = collectives.Comm(comm.mpi, path=path)
    if streaming:
        sub._engine.nt_mode, sub._engine.nt_floor = 1, 0
    try:
        assert sub.allreduce_path(8) == sub.allreduce_path(64 << 20, True) == path
        # The instance's allreduce is the engine's entry point; it takes every size
        # without Python when the table says shm1 or shm2 from the smallest size up.
        assert "allreduce" in vars(sub)
        assert (sub._engine.limit_out, sub._engine.limit_in) == (1 << 62,) * 2
        steps = 3 * shm1.cap_for(comm.local_size) // 8 + 5  # float64: 3 slots and a tail
        for dtype in _reduce_dtypes():
            for op in collectives.dtypes.REDUCE_OPS:
                if dt.reduce_problem(dtype, op):
                    continue
                for n in (0, 1, 7, 1001) + ((steps,) if dtype in (np.float64, np.int32) else ()):
                    full, vals = _expect(comm, n, dtype, op)
                    want = dt.from_float64(full, dtype)
                    x = dt.from_float64(vals[comm.rank], dtype)
                    keep = x.copy()
                    for form in ("new", "out", "inplace", "out=x", "positional"):
                        y = x.copy()
                        if form == "new":
                            got = sub.allreduce(x, op)
                            assert got is not x and np.array_equal(x.view(np.uint8), keep.view(np.uint8))
                        elif form == "out":
                            o = np.empty_like(x)
                            got = sub.allreduce(x, op=op, out=o)
                            assert got is o
                        elif form == "inplace":
                            got = sub.allreduce(y, op, inplace=True)
                            assert got is y
                        elif form == "out=x":
                            got = sub.allreduce(y, op=op, out=y)
                            assert got is y
                        else:
                            o = np.empty_like(x)
                            got = sub.allreduce(x, op, o, False)
                            assert got is o
                        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), \
                            f"{path} {dt.dtype_name(dtype)} {op} n={n} {form}: {got[:8]} != {want[:8]}"
        # grouped_allreduce through the engine: arrays reduced where they are, as one stream
        # crossing slot steps and slice boundaries inside arrays (sizes from 1 element).
        sizes = [1, 3, 17, 1000, 40000, 5, 70001, 2, 16384, 9999]
        for dtype in (np.float32, np.int64, np.float64):
            work = [_pat(k, comm.rank + i, dtype) for i, k in enumerate(sizes)]
            sub.grouped_allreduce(work, fusion_threshold=1 << 26)
            for i, (k, w) in enumerate(zip(sizes, work)):
                want = sum(_pat(k, r + i) for r in range(comm.size)).astype(dtype)
                assert w.tobytes() == want.tobytes(), f"{path} grouped {dtype} array {i}"
        noisy = [np.random.default_rng(comm.rank * 100 + i).standard_normal(k).astype(np.float32)
                 for i, k in enumerate(sizes)]
        sub.grouped_allreduce(noisy, op="avg")
        assert _same_everywhere(comm, np.concatenate(noisy))
        shaped = _pat(24, comm.rank, np.float32).reshape(2, 3, 4)
        got = sub.allreduce(shaped)
        assert got.shape == (2, 3, 4)
        np.testing.assert_array_equal(got, _total(comm, 24, np.float32).reshape(2, 3, 4))
        rng = np.random.default_rng(comm.rank)
        for n in (5, 5003, steps):
            f = rng.standard_normal(n).astype(np.float32)
            assert _same_everywhere(comm, sub.allreduce(f))
            assert _same_everywhere(comm, sub.allreduce(f, "avg"))
        # What the compiled entry does not take gets the Python path's checks and errors.
        strided = _pat(20, comm.rank, np.float32)[::2]
        _raises(NotContiguousError, lambda: sub.allreduce(strided), "C-contiguous")
        _raises(ShapeError, lambda: sub.allreduce(np.ones(4, np.float32), out=np.empty(5, np.float32)),
                "out has shape (5,)")
        _raises(ShapeError, lambda: sub.allreduce(np.ones(4, np.float32), out=np.empty(4, np.float64)),
                "dtype float32")
        _raises(CollectiveError, lambda: sub.allreduce(np.ones(4, np.int32), op="avg"), "average")
        _raises(CollectiveError, lambda: sub.allreduce(np.ones(4, np.float32), op="xor"), "unknown reduction op")
        _raises(TypeError, lambda: sub.allreduce(np.ones(4, np.float32), bogus=1), "bogus")
        sub.check = True  # every call now compares signatures first (Python)
        np.testing.assert_array_equal(sub.allreduce(_pat(9, comm.rank)), _total(comm, 9))
        if comm.size > 1:
            x = np.ones(3 if comm.rank == 0 else 4, np.float32)
            _raises(MismatchError, lambda: sub.allreduce(x), "element count")
        sub.check = False
        np.testing.assert_array_equal(sub.allreduce(_pat(9, comm.rank)), _total(comm, 9))
        kept = sub.allreduce  # the engine's entry, kept past free()
        assert sub._engine.nt_calls > 0 or not streaming
    finally:
        sub.free()
    assert sub.allreduce_path(8) == "mpi" and "allreduce" not in vars(sub)  # Comm.allreduce again
    # the freed engine takes nothing: the kept entry falls back to Comm.allreduce (MPI)
    np.testing.assert_array_equal(kept(_pat(9, comm.rank)), _total(comm, 9))


def case_shm1_waits(comm):
    """The compiled engine's waits spin when the late rank runs on another CPU and yield
    at once when it last ran on this one: ranks pinned to separate CPUs never count a
    shared-CPU wait; pinned to one CPU they do (and still finish, with exact sums)."""
    from dtrun.collectives import shm1
    if comm.local_size < 2 or comm.nnodes > 1 or not shm1.available():
        raise Skip("needs the compiled engine and several ranks on one host only")
    cpus = sorted(os.sched_getaffinity(0))
    sub = collectives.Comm(comm.mpi, path="shm1")
    try:
        eng = sub._engine
        # more ranks than CPUs: every wait yields after a short spin (no CPU test to make)
        assert bool(eng.yield_always) == (comm.local_size > shm1.usable_cpus())
        if eng.yield_always:
            assert (eng.spin_ns, eng.yield_ns) == (shm1.OVERSUBSCRIBED_SPIN_NS, shm1.OVERSUBSCRIBED_YIELD_NS)
            return
        x = np.full(2, comm.rank + 1.0)
        want = np.full(2, comm.size * (comm.size + 1) / 2)

        def run(cpu_set):
            os.sched_setaffinity(0, cpu_set)
            for _ in range(20):  # every rank posts from its new CPU before counting starts
                sub.allreduce(x)
            comm.mpi.Barrier()
            before = eng.shared_waits
            for _ in range(300):
                np.testing.assert_array_equal(sub.allreduce(x), want)
            got = eng.shared_waits - before
            comm.mpi.Barrier()  # nobody still runs the old pinning's steps
            return comm.mpi.allreduce(got)

        try:
            assert run({cpus[comm.local_rank % len(cpus)]}) == 0
            assert run({cpus[0]}) > 0
        finally:
            os.sched_setaffinity(0, cpus)
        # barrier_ns keeps the ranks' epochs in step: the sums after it stay exact
        assert sub.shm_barrier_ns(200) > 0
        np.testing.assert_array_equal(sub.allreduce(x), want)
        no_shm = collectives.Comm(comm.mpi, shm=False)
        try:
            assert no_shm.shm_barrier_ns(10) is None
        finally:
            no_shm.free()
    finally:
        sub.free()


def _reduce_dtypes():
    from dtrun.collectives import dtypes as dt
    return [d for d in dt._MPI_TYPE if dt.reduce_problem(d, "sum") is None]


def _expect(comm, n, dtype, op):
    """Exact result of reducing ``_pat(n, rank)`` (small integers) over the ranks."""
    vals = np.array([_pat(n, k) for k in range(comm.size)]).reshape(comm.size, n)
    if op == "prod":
        vals = np.where(vals > 2, 1.0, vals)  # products stay small enough for int8
    if op == "avg":
        vals = vals * comm.size  # the average is an integer: exact in every float type
    full = {"sum": vals.sum(0), "prod": vals.prod(0), "min": vals.min(0), "max": vals.max(0),
            "avg": vals.sum(0) / comm.size}[op]
    return full, vals


def case_ring_exact(comm):
    """The ring path: every dtype and op the runtime reduces, counts that the ranks do not
    divide (and fewer elements than ranks), in and out of place, exact everywhere."""
    from dtrun.collectives import dtypes as dt
    from dtrun.collectives.ring import Ring
    if comm.size > 1:
        # Every rank its own "host": the layout where the ring is a path.
        solo = comm.mpi.Split(comm.rank, 0)
        sub = collectives.Comm(comm.mpi, node_comm=solo, path="ring")
        assert sub.allreduce_path(1) == "ring" and "path='ring'" in sub.allreduce_reason(1)
        reduce = lambda x, op, inplace: (sub.allreduce(x, op=op, inplace=True) if inplace
                                         else sub.allreduce(x, op=op))  # noqa: E731
    else:
        ring = Ring(comm.mpi.Dup())
        assert ring.p == 1

        def reduce(x, op, inplace):
            t, mop, kern, finish, _, _ = comm._redop(x, op, "allreduce")
            out = x if inplace else np.empty_like(x)
            ring.allreduce(x, out, kern, finish)
            return out
    for dtype in _reduce_dtypes():
        for op in collectives.dtypes.REDUCE_OPS:
            if dt.reduce_problem(dtype, op):
                continue
            for n in (0, 1, max(1, comm.size - 1), 7, 1001):
                full, vals = _expect(comm, n, dtype, op)
                mine = vals[comm.rank]
                for inplace in (False, True):
                    x = dt.from_float64(mine, dtype)
                    got = reduce(x, op, inplace)
                    assert (got is x) == inplace
                    want = dt.from_float64(full, dtype)
                    assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), \
                        f"{dt.dtype_name(dtype)} {op} n={n} inplace={inplace}: {got[:8]}"
    rng = np.random.default_rng(comm.rank)
    f = rng.standard_normal(5003).astype(np.float32)
    assert _same_everywhere(comm, reduce(f, "sum", False))


def _path_codes(comm, c):
    """Every bucket's path, in and out of place, as numbers (to compare across ranks)."""
    from dtrun.collectives import tuning
    return np.array([tuning.PATHS.index(c.allreduce_path(b, ip)) for ip in (False, True)
                     for b in tuning.BUCKETS + (3, 5 << 20, 64 << 20)], dtype=np.int64)


def _with_env(values: dict, make):
    """``make()`` with ``values`` set in os.environ, which is restored after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items()})
    try:
        return make()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def case_path_selection_agrees(comm):
    """A measured path table: the same path for every size on every rank, and every size
    bucket reduces correctly along its path."""
    from dtrun.collectives import tuning
    sub = _with_env({"DTRUN_TUNE": "refresh"}, lambda: collectives.Comm(comm.mpi))
    try:
        codes = _path_codes(comm, sub)
        assert _same_everywhere(comm, codes)
        if comm.size > 1 and comm.local_size > 1 and os.environ.get("DTRUN_SHM", "1") != "0":
            assert "calibrated on" in sub.allreduce_reason(1 << 20)
        for b in tuning.BUCKETS:
            n = b // 8
            for inplace in (False, True):
                x = _pat(n, comm.rank)
                got = sub.allreduce(x, inplace=inplace)
                np.testing.assert_array_equal(got, _total(comm, n))
    finally:
        sub.free()


def case_path_env_overrides(comm):
    """DTRUN_SHM_THRESHOLD / DTRUN_SHM_CHUNK / DTRUN_SHM=0 / DTRUN_ALLREDUCE_PATH win over
    measurement, and say so."""
    shm_here = comm.local_size > 1
    sub = _with_env({"DTRUN_SHM_THRESHOLD": "1M", "DTRUN_SHM_CHUNK": "64K"},
                    lambda: collectives.Comm(comm.mpi))
    try:
        assert sub.allreduce_path(1 << 19) == "mpi"
        assert sub.allreduce_path(1 << 20) == ("shm" if shm_here else "mpi")
        if shm_here:
            why = sub.allreduce_reason(4 << 20)
            assert "env DTRUN_SHM_THRESHOLD=1M" in why and "chunk 64 KiB" in why, why
        x = _pat(300000, comm.rank)
        np.testing.assert_array_equal(sub.allreduce(x), _total(comm, 300000))
    finally:
        sub.free()
    off = _with_env({"DTRUN_SHM": "0"}, lambda: collectives.Comm(comm.mpi))
    assert {off.allreduce_path(b) for b in (8, 1 << 20, 64 << 20)} == {"mpi"}
    forced = _with_env({"DTRUN_ALLREDUCE_PATH": "mpi"}, lambda: collectives.Comm(comm.mpi))
    assert forced.allreduce_path(64 << 20) == "mpi"
    if comm.size > 1:
        assert "DTRUN_ALLREDUCE_PATH=mpi" in forced.allreduce_reason(64 << 20)
        # A path this layout does not offer is refused on every rank alike.
        _raises(ValueError, lambda: _with_env({"DTRUN_ALLREDUCE_PATH": "shm+ring"},
                                              lambda: collectives.Comm(comm.mpi)),
                "DTRUN_ALLREDUCE_PATH=shm+ring", "this layout offers")
    _raises(ValueError, lambda: _with_env({"DTRUN_TUNE": "yes"}, lambda: collectives.Comm(comm.mpi)),
            "DTRUN_TUNE='yes'", "refresh")
    for bad in ("abc", "nan", "inf"):  # rank 0 alone reads it at the end of a measurement: every rank refuses it first
        _raises(ValueError, lambda: _with_env({"DTRUN_TUNE_MAX_LOAD": bad}, lambda: collectives.Comm(comm.mpi)),
                f"DTRUN_TUNE_MAX_LOAD={bad!r}")
    fixed = _with_env({"DTRUN_TUNE": "0"}, lambda: collectives.Comm(comm.mpi))
    try:
        if shm_here:
            assert fixed.allreduce_path(256 << 10) == "shm"
            assert "DTRUN_TUNE=0" in fixed.allreduce_reason(256 << 10)
        assert fixed.allreduce_path(8) == "mpi"
    finally:
        fixed.free()


def _full_measurement(mpi, cands, run, first=0, rounds=None, budget=None, tick=None):
    """tuning.measure as on an idle host: every size measured, the same times on every rank."""
    from dtrun.collectives import tuning
    times = np.full((len(tuning.BUCKETS), 2, len(cands)), 1e-4)
    times[:first, :, 0] = tuning.NOT_MEASURED
    return times


def case_path_cache_corrupt(comm):
    """A cache file that does not parse, or an entry that does not fit, is discarded and
    measured again; the rewritten file parses.

    The measurement itself is replaced by a full one (``_full_measurement``): a real one on a
    busy host runs out of its time budget before 1 MiB and is then, by design, used but not
    cached ("not cached: the time budget ran out", tests/test_tuning_measure.py), which is
    not what this case is about (it failed so under load, with 2 ranks on 2 cores)."""
    import json
    import shutil
    import tempfile

    from dtrun.collectives import cache, tuning
    tmp = tempfile.mkdtemp(prefix="dtrun-tune-")
    real_measure, tuning.measure = tuning.measure, _full_measurement
    try:
        cands = [("mpi", 0)] + ([("shm", tuning.CHUNKS[0])] if comm.local_size > 1 else [])

        def measured(content, max_load="1e9"):
            path = os.path.join(tmp, "dtrun", tuning.CACHE_FILE)
            if comm.rank == 0:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(content)
            comm.barrier()
            table = _with_env(
                {"XDG_CACHE_HOME": tmp, "DTRUN_TUNE_MAX_LOAD": max_load},
                lambda: tuning.calibrated(comm.mpi, comm.host, comm.local_size, comm.nnodes,
                                          cands, comm._calibration_run))
            ok = np.array([1], np.int64)
            if comm.rank == 0:
                doc = cache.load(cache.Path(path))
                ok[0] = int(len(doc) == 1 and tuning._valid_rows(next(iter(doc.values()))["rows"],
                                                                 cands))
            comm.mpi.Bcast(ok, root=0)
            return table, bool(ok[0])

        for junk in ("{not json", "[1, 2, 3]", "\x00\xff garbage"):
            table, ok = measured(junk)
            assert "(now," in table.source and ok, (junk, table.source)
        # An entry under the right key with rows that do not fit: discarded too.
        hosts = tuning._hosts(comm.mpi, comm.host)
        key = tuning.cache_key(hosts, comm.local_size, comm.nnodes, cands)
        bad = {key: {"rows": [[["warp", 0, 1.0, 1.0]] * len(tuning.BUCKETS)] * 2, "when": "x"}}
        table, ok = measured(json.dumps(bad))
        assert "(now," in table.source and ok
        # A good entry is used as it is.
        table, ok = measured(open(os.path.join(tmp, "dtrun", tuning.CACHE_FILE)).read()
                             if comm.rank == 0 else "")
        assert "(cached," in table.source and ok
        # Measured on an overloaded host (every load exceeds -1 x cores): used, not written.
        table, ok = measured("{}", max_load="-1")
        assert "not cached: load" in table.source and not ok
    finally:
        tuning.measure = real_measure
        shutil.rmtree(tmp, ignore_errors=True)


def case_soft_floats(comm):
    """float16 and bfloat16 (no MPI datatype): user-defined MPI ops and the shm path."""
    from dtrun.collectives import dtypes as dt
    for threshold in (1 << 30, 1024):  # MPI path, then shm path
        sub = collectives.Comm(comm.mpi, shm_threshold=threshold)
        try:
            for dtype in (np.dtype(np.float16), dt.BFLOAT16):
                x = dt.from_float64(_pat(3000, comm.rank), dtype)
                got = dt.to_float64(sub.allreduce(x))
                np.testing.assert_array_equal(got, _total(comm, 3000))
                got = dt.to_float64(sub.allreduce(dt.from_float64(np.full(3000, 1.0 * comm.rank),
                                                                  dtype), op="avg"))
                np.testing.assert_array_equal(got, np.full(3000, (comm.size - 1) / 2))
                got = dt.to_float64(sub.allreduce(x, op="max"))
                np.testing.assert_array_equal(
                    got, np.max([_pat(3000, k) for k in range(comm.size)], 0))
        finally:
            sub.free()


def case_broadcast(comm):
    for root in {0, comm.size - 1}:
        x = _pat(11, comm.rank * 10)
        got = comm.broadcast(x, root=root)
        np.testing.assert_array_equal(got, _pat(11, root * 10))
        np.testing.assert_array_equal(x, _pat(11, comm.rank * 10))
        y = _pat(11, comm.rank * 10).reshape(1, 11)
        assert comm.broadcast(y, root=root, inplace=True) is y
        np.testing.assert_array_equal(y[0], _pat(11, root * 10))
        out = np.empty(11)
        assert comm.broadcast(x, root=root, out=out) is out
        np.testing.assert_array_equal(out, _pat(11, root * 10))


def case_scatter(comm):
    size, root = comm.size, comm.size - 1
    full = np.concatenate([_pat(4, 10 * k) for k in range(size)]).reshape(size * 2, 2)
    part = comm.scatter(full, root=root)
    np.testing.assert_array_equal(part.reshape(-1), _pat(4, 10 * comm.rank))
    x = full.copy() if comm.rank == root else np.zeros_like(full)
    view = comm.scatter(x, root=root, inplace=True)
    np.testing.assert_array_equal(view.reshape(-1), _pat(4, 10 * comm.rank))
    assert np.shares_memory(view, x)
    out = np.empty((2, 2))
    got = comm.scatter(full if comm.rank == root else None, root=root, out=out)
    assert got is out
    np.testing.assert_array_equal(out.reshape(-1), _pat(4, 10 * comm.rank))


def case_gather(comm):
    size = comm.size
    for root in {0, size - 1}:
        x = _pat(3, comm.rank).reshape(3, 1)
        got = comm.gather(x, root=root)
        if comm.rank == root:
            np.testing.assert_array_equal(got.reshape(-1),
                                          np.concatenate([_pat(3, k) for k in range(size)]))
        else:
            assert got is None
        buf = np.zeros(3 * size)
        buf[comm.rank * 3:(comm.rank + 1) * 3] = _pat(3, comm.rank)
        got = comm.gather(buf, root=root, inplace=True)
        if comm.rank == root:
            assert got is buf
            np.testing.assert_array_equal(buf, np.concatenate([_pat(3, k) for k in range(size)]))


def case_gatherv_allgatherv(comm):
    """Per-rank lengths differ (rank 0 contributes nothing)."""
    mine = _pat(comm.rank * 2, comm.rank).reshape(comm.rank, 2) if comm.rank else \
        np.zeros((0, 2))
    expect = np.concatenate([_pat(k * 2, k) for k in range(comm.size)]).reshape(-1, 2)
    got = comm.allgatherv(mine)
    np.testing.assert_array_equal(got, expect)
    got = comm.gatherv(mine, root=comm.size - 1)
    if comm.rank == comm.size - 1:
        np.testing.assert_array_equal(got, expect)
    else:
        assert got is None


def case_reduce(comm):
    root = comm.size - 1
    x = _pat(9, comm.rank)
    got = comm.reduce(x, root=root)
    if comm.rank == root:
        np.testing.assert_array_equal(got, _total(comm, 9))
    else:
        assert got is None
    y = x.copy()
    got = comm.reduce(y, op="avg", root=root, inplace=True)
    if comm.rank == root:
        assert got is y
        np.testing.assert_array_equal(y, _total(comm, 9) / comm.size)
    else:
        np.testing.assert_array_equal(y, x)


def case_allgather(comm):
    x = _pat(6, comm.rank, np.int32).reshape(2, 3)
    got = comm.allgather(x)
    assert got.shape == (2 * comm.size, 3)
    np.testing.assert_array_equal(got.reshape(comm.size, -1),
                                  np.array([_pat(6, k, np.int32) for k in range(comm.size)]))
    buf = np.zeros((2 * comm.size, 3), np.int32)
    buf[2 * comm.rank:2 * comm.rank + 2] = x
    assert comm.allgather(buf, inplace=True) is buf
    np.testing.assert_array_equal(buf, got)


def case_reduce_scatter(comm):
    size = comm.size
    x = _pat(4 * size, comm.rank)
    full = _total(comm, 4 * size)
    got = comm.reduce_scatter(x)
    np.testing.assert_array_equal(got, full[4 * comm.rank:4 * comm.rank + 4])
    got = comm.reduce_scatter(x.copy(), inplace=True)
    np.testing.assert_array_equal(got, full[4 * comm.rank:4 * comm.rank + 4])
    got = comm.reduce_scatter(np.full(2 * size, 1.0 * comm.rank), op="avg")
    np.testing.assert_array_equal(got, np.full(2, (size - 1) / 2))


def case_alltoall(comm):
    size = comm.size
    x = np.concatenate([_pat(3, 100 * comm.rank + j) for j in range(size)])
    expect = np.concatenate([_pat(3, 100 * j + comm.rank) for j in range(size)])
    np.testing.assert_array_equal(comm.alltoall(x), expect)
    y = x.copy()
    assert comm.alltoall(y, inplace=True) is y
    np.testing.assert_array_equal(y, expect)


def case_send_recv(comm):
    """Ping-pong between rank 0 and the last rank; self-send on one rank."""
    size, rank = comm.size, comm.rank
    if size == 1:
        h = comm.irecv(np.empty(5), source=0, tag=7)
        comm.send(_pat(5, 3), 0, tag=7)
        np.testing.assert_array_equal(h.wait(), _pat(5, 3))
        return
    last = size - 1
    buf = np.empty(5)
    if rank == 0:
        comm.send(_pat(5, 1), last, tag=1)
        comm.recv(buf, source=last, tag=2)
        np.testing.assert_array_equal(buf, _pat(5, 1) * 2)
    elif rank == last:
        comm.recv(buf, source=0, tag=1)
        comm.send(buf * 2, 0, tag=2)
    # Ring with non-blocking calls.
    out = np.empty(4, np.int64)
    r = comm.irecv(out, source=(rank - 1) % size)
    s = comm.isend(_pat(4, rank, np.int64), (rank + 1) % size)
    s.wait()
    np.testing.assert_array_equal(r.wait(), _pat(4, (rank - 1) % size, np.int64))
    got = comm.sendrecv(_pat(2, rank), (rank + 1) % size, np.empty(2), (rank - 1) % size)
    np.testing.assert_array_equal(got, _pat(2, (rank - 1) % size))


def case_async(comm):
    size = comm.size
    h1 = comm.iallreduce(_pat(1000, comm.rank))
    h2 = comm.ibroadcast(_pat(10, comm.rank), root=0)
    h3 = comm.iallgather(_pat(4, comm.rank))
    h4 = comm.ireduce_scatter(_pat(2 * size, comm.rank))
    h5 = comm.ialltoall(np.concatenate([_pat(2, 100 * comm.rank + j) for j in range(size)]))
    h6 = comm.ireduce(_pat(3, comm.rank), op="avg", root=0)
    work = np.sum(np.arange(10000))  # overlap: compute while the collectives progress
    deadline = time.monotonic() + 20
    while not all(h.test() for h in (h1, h2, h3, h4, h5, h6)):
        assert time.monotonic() < deadline, "non-blocking collectives never completed"
    assert work > 0
    np.testing.assert_array_equal(h1.wait(), _total(comm, 1000))
    np.testing.assert_array_equal(h2.wait(), _pat(10, 0))
    np.testing.assert_array_equal(h3.wait(), np.concatenate([_pat(4, k) for k in range(size)]))
    np.testing.assert_array_equal(h4.wait(), _total(comm, 2 * size)[2 * comm.rank:2 * comm.rank + 2])
    np.testing.assert_array_equal(h5.wait(),
                                  np.concatenate([_pat(2, 100 * j + comm.rank) for j in range(size)]))
    r = h6.wait()
    if comm.rank == 0:
        np.testing.assert_array_equal(r, _total(comm, 3) / size)
    x = _pat(64, comm.rank)
    h = comm.iallreduce(x, op="avg", inplace=True)
    assert h.wait() is x
    np.testing.assert_array_equal(x, _total(comm, 64) / size)


def case_grouped(comm):
    arrays = [_pat(n, comm.rank, dt) for n, dt in
              [(1000, np.float32), (1, np.float32), (7, np.float64), (3000, np.float32),
               (0, np.float32), (50, np.int64), (20000, np.float32)]]
    arrays[3] = arrays[3].reshape(30, 100)
    ids = [id(a) for a in arrays]
    # The second communicator sends fused buffers through the shared-memory path
    # (packed straight into shared memory) on hosts with several ranks.
    shm_comm = collectives.Comm(comm.mpi, shm_threshold=1024)
    try:
        for c in (comm, shm_comm):
            for threshold in (4096, 1 << 26):  # many buffers (one oversized array), then one
                work = [a.copy() for a in arrays]
                for _ in range(2):  # the second call takes the cached plan
                    for w, orig in zip(work, arrays):
                        w[...] = orig
                    out = c.grouped_allreduce(work, fusion_threshold=threshold)
                    assert [id(a) for a in out] == [id(a) for a in work]
                    for a, orig in zip(work, arrays):
                        np.testing.assert_array_equal(a.reshape(-1),
                                                      _total(comm, orig.size, orig.dtype))
            # A list with the same length, first and last array but another in the middle
            # must not take the cached plan (which points at the old array's memory).
            work = [a.copy() for a in arrays]
            c.grouped_allreduce(work, fusion_threshold=4096)
            old, work[3] = work[3], arrays[3].copy()
            kept = old.copy()
            c.grouped_allreduce(work, fusion_threshold=4096)
            np.testing.assert_array_equal(work[3].reshape(-1),
                                          _total(comm, arrays[3].size, arrays[3].dtype))
            np.testing.assert_array_equal(old, kept)
            avg = [np.full(1000, 1.0 * comm.rank), np.full(3, 2.0 * comm.rank, np.float32),
                   np.full(700, 3.0 * comm.rank)]
            c.grouped_allreduce(avg, op="avg")
            np.testing.assert_array_equal(avg[0], np.full(1000, (comm.size - 1) / 2))
            np.testing.assert_array_equal(avg[1], np.full(3, comm.size - 1.0))
            np.testing.assert_array_equal(avg[2], np.full(700, 1.5 * (comm.size - 1)))
    finally:
        shm_comm.free()
    assert [id(a) for a in arrays] == ids


def case_fusion_env(comm):
    sub = _with_env({"DTRUN_FUSION_THRESHOLD": "2K"}, lambda: collectives.Comm(comm.mpi))
    assert sub.fusion_threshold == 2048
    xs = [_pat(100, comm.rank) for _ in range(10)]
    sub.grouped_allreduce(xs)
    for a in xs:
        np.testing.assert_array_equal(a, _total(comm, 100))


def case_split(comm):
    node = comm.split_by_node()
    assert node.size == comm.local_size and node.rank == comm.local_rank and node.nnodes == 1
    color = comm.rank % 2
    sub = comm.split(color, key=-comm.rank)  # reversed order inside each half
    members = [k for k in range(comm.size) if k % 2 == color]
    assert sub.size == len(members)
    assert sub.rank == len(members) - 1 - members.index(comm.rank)
    got = sub.allreduce(np.array([comm.rank], np.int64))
    assert int(got[0]) == sum(members)
    none = comm.split(None if comm.rank == 0 else 1)
    assert (none is None) == (comm.rank == 0)


def case_errors_local(comm):
    """Errors detected on the calling rank: name the op, the rank and the problem."""
    a = np.zeros((4, 4), np.float32)
    e = _raises(NotContiguousError, lambda: comm.allreduce(a[:, 1]), "allreduce",
                f"rank {comm.rank}", "not C-contiguous")
    assert isinstance(e, CollectiveError)
    _raises(NotContiguousError, lambda: comm.broadcast(a.T), "broadcast", "contiguous")
    _raises(UnsupportedDtypeError, lambda: comm.allreduce(np.zeros(3, object)),
            "allreduce", "dtype object is not supported", "float32")
    _raises(UnsupportedDtypeError, lambda: comm.allgather(np.zeros(3, np.str_)), "allgather")
    _raises(UnsupportedDtypeError, lambda: comm.allreduce(np.zeros(3, np.int32), op="avg"),
            "average", "int32")
    _raises(CollectiveError, lambda: comm.allreduce(np.zeros(3), op="median"),
            "unknown reduction op 'median'")
    _raises(ShapeError, lambda: comm.allreduce(np.zeros(3), out=np.zeros(4)),
            "out has shape (4,)")
    _raises(UnsupportedDtypeError, lambda: comm.allreduce([1.0, 2.0]), "got builtins.list")
    _raises(UnsupportedDtypeError, lambda: comm.allreduce(np.zeros(2, bool)), "bool")
    if comm.size > 1:
        _raises(ShapeError, lambda: comm.scatter(np.zeros(comm.size + 1)), "scatter",
                f"length {comm.size + 1}", "evenly")
        _raises(ShapeError, lambda: comm.alltoall(np.zeros(comm.size * 2 + 1)), "alltoall")


def case_errors_truncation(comm):
    """A receive buffer smaller than the message: MPI's error, translated and explained."""
    from dtrun.collectives import MPIError
    if comm.size == 1:
        h = comm.isend(np.ones(10), 0, tag=9)
        _raises(MPIError, lambda: comm.recv(np.empty(5), source=0, tag=9), "recv",
                "smaller than the message")
        h.wait()
        return
    last = comm.size - 1
    if comm.rank == 0:
        comm.send(np.ones(10), last, tag=9)
    elif comm.rank == last:
        _raises(MPIError, lambda: comm.recv(np.empty(5), source=0, tag=9), "recv",
                f"rank {last}", "smaller than the message")


def case_errors_mismatch(comm):
    """Mismatches across ranks with DTRUN_CHECK=1 (the full exchange's messages; the
    default check's matrix is tests/test_mismatch.py)."""
    if comm.size == 1:
        raise Skip("needs 2+ ranks to disagree")
    dtype = np.float32 if comm.rank == 0 else np.float64
    _raises(MismatchError, lambda: comm.allgatherv(np.zeros(3, dtype)), "allgatherv",
            "dtypes differ", "rank 0: float32", "rank 1: float64")
    checked = collectives.Comm(comm.mpi, check=True)
    n = 10 if comm.rank == 0 else 11
    _raises(MismatchError, lambda: checked.allreduce(np.zeros(n)), "allreduce",
            f"rank {comm.rank}", "element count differs", "rank 0: 10", "rank 1: 11")
    _raises(MismatchError, lambda: checked.allreduce(np.zeros(4, dtype)), "dtype differs")
    op = "sum" if comm.rank == 0 else "max"
    _raises(MismatchError, lambda: checked.allreduce(np.zeros(4), op=op), "reduction op differs")
    _raises(MismatchError, lambda: checked.broadcast(np.zeros(4), root=comm.rank % 2), "root")
    # Matching calls pass the check.
    np.testing.assert_array_equal(checked.allreduce(np.ones(4)), np.full(4, comm.size))


def case_torch_cpu(comm):
    try:
        import torch
    except ImportError:
        raise Skip("torch is not installed (pip install torch, CPU build)") from None
    t = torch.arange(6, dtype=torch.float32) + comm.rank
    r = comm.allreduce(t)
    assert isinstance(r, torch.Tensor)
    expect = sum(torch.arange(6, dtype=torch.float32) + k for k in range(comm.size))
    assert torch.equal(r, expect)
    u = t.clone()
    assert comm.allreduce(u, inplace=True) is u and torch.equal(u, expect)
    v = t.clone()
    assert v.numpy().ctypes.data == u.numpy().ctypes.data or True  # zero-copy views
    b = (torch.ones(5) * (comm.rank + 1)).to(torch.bfloat16)
    rb = comm.allreduce(b)
    assert rb.dtype == torch.bfloat16 and torch.equal(rb.float(),
                                                        torch.full((5,), comm.size * (comm.size + 1) / 2))
    g = comm.allgather(t.to(torch.int64))
    assert g.shape == (6 * comm.size,) and g.dtype == torch.int64
    h = comm.iallreduce(t, op="avg")
    assert torch.equal(h.wait(), expect / comm.size)
    grads = [torch.ones(3) * comm.rank, torch.ones(2, dtype=torch.float64)]
    comm.grouped_allreduce(grads)
    assert torch.equal(grads[1], torch.full((2,), float(comm.size), dtype=torch.float64))
    _raises(NotContiguousError, lambda: comm.allreduce(torch.ones(4, 4).t()), "contiguous()")
    out = torch.empty(6)
    assert comm.broadcast(t, root=0, out=out) is out and torch.equal(out, torch.arange(6.0))


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def run_cases(comm, names=None) -> dict:
    """Run the named cases (default: all) on ``comm``; return this rank's report."""
    report = {"rank": comm.rank, "size": comm.size, "passed": [], "failed": {}, "skipped": {}}
    for name in names or CASES:
        try:
            CASES[name](comm)
        except Skip as s:
            report["skipped"][name] = str(s)
        except Exception:
            report["failed"][name] = traceback.format_exc()
        else:
            report["passed"].append(name)
        comm.barrier()  # cases never overlap, even if one rank failed early
    return report


def _watchdog(seconds: float) -> None:
    def run():
        time.sleep(seconds)
        print(f"CASES-HANG: cases did not finish within {seconds:g} s", flush=True)
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(3)
    threading.Thread(target=run, daemon=True).start()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = None
    if "--only" in argv:
        names = argv[argv.index("--only") + 1].split(",")
    _watchdog(float(os.environ.get("COLLECTIVES_CASES_TIMEOUT", "120")))
    comm = collectives.init()
    report = run_cases(comm, names)
    print("CASES " + json.dumps(report), flush=True)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
