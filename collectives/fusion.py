"""grouped_allreduce's fusion plans: which arrays are reduced together, and how.

A plan splits a list of NumPy arrays into steps: an ``Alone`` step reduces one large
array in place; a ``Fused`` step covers a batch of same-dtype arrays with one hindexed
MPI datatype, so they are packed, reduced as one buffer and unpacked in C (a Python
loop over 256 small arrays costs more than the allreduce itself). Plans are built once
per list and cached by the identity of its arrays, as a training loop passes the same
gradient arrays every step: a cached call costs one lookup and an identity check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from . import dtypes as _dt
from . import signature as _sig
from ._mpi import MPI
from .errors import CollectiveError, ReadOnlyError
from .shm import SINGLE_STEP_MAX

DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024
# An array this large is reduced on its own, in place (packing it costs two copies and
# saves a per-call overhead it does not notice), and fused buffers stay at most
# SINGLE_STEP_MAX, so they are packed straight into shared memory and stay in cache.
FUSE_ALONE_BYTES = 1 << 20
CACHED_PLANS = 8


@dataclass(slots=True, frozen=True)
class Alone:
    """One array reduced on its own, in place."""

    array: np.ndarray


@dataclass(slots=True, frozen=True)
class Fused:
    """A batch of same-dtype arrays reduced as one buffer of ``count`` elements.

    ``datatype`` (hindexed, committed) describes the arrays relative to the start of
    ``memory``, a buffer spanning them all; ``pairs`` holds each array's (address,
    bytes), the compiled engine's view of the same batch."""

    datatype: Any
    memory: Any
    dtype: np.dtype
    count: int
    pairs: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def pack(self, into) -> None:
        self.datatype.Pack(self.memory, into, 0, MPI.COMM_SELF)

    def unpack(self, source) -> None:
        self.datatype.Unpack(source, 0, self.memory, MPI.COMM_SELF)


Step = Alone | Fused


@dataclass(slots=True, frozen=True)
class Plan:
    """The steps for one list of arrays, the list itself (the cache keeps its arrays
    alive, so their ids and addresses stay valid), its signature words and the op they
    were computed for."""

    steps: tuple[Step, ...]
    arrays: list
    words: tuple[int, int, int]
    op: Any

    def free(self) -> None:
        for step in self.steps:
            if type(step) is Fused:
                step.datatype.Free()


class Plans:
    """The last ``CACHED_PLANS`` plans of one communicator, keyed by (length, first
    array's id, last array's id, threshold) and then checked array by array by identity
    (about 3x cheaper than hashing every id). ``built`` counts plans built. ``bufs``:
    one fusion buffer per dtype, reused by every call."""

    __slots__ = ("cache", "built", "same_items", "bufs")

    def __init__(self, same_items: Callable[[Sequence, Sequence], bool]) -> None:
        self.cache: dict[tuple, Plan] = {}
        self.built = 0
        self.same_items = same_items
        self.bufs: dict[np.dtype, np.ndarray] = {}

    def rep(self, dtype: np.dtype) -> np.ndarray:
        """A small array of ``dtype`` (for op/dtype lookups keyed by an array)."""
        buf = self.bufs.get(dtype)
        if buf is None:
            buf = self.bufs[dtype] = np.empty(1024, dtype=dtype)
        return buf

    def buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        """The fusion buffer of ``dtype``, ``count`` elements long."""
        buf = self.bufs.get(dtype)
        if buf is None or buf.size < count:
            buf = self.bufs[dtype] = np.empty(max(count, 1024), dtype=dtype)
        return buf[:count]

    def lookup(self, arrays: Sequence[Any], threshold: int) -> tuple[tuple, Plan | None]:
        """(key, the cached plan for exactly these arrays, or None)."""
        key = (len(arrays), id(arrays[0]), id(arrays[-1]), threshold)
        plan = self.cache.get(key)
        if plan is not None and not self.same_items(arrays, plan.arrays):
            self.cache.pop(key).free()
            plan = None
        return key, plan

    def build(self, arrays: Sequence[np.ndarray], threshold: int, key: tuple, op: Any,
              validate: Callable[[np.ndarray, str], Any], rank: int, cache: bool = True) -> Plan:
        """Validate ``arrays`` once (``validate``: dtype and contiguity; read-only arrays
        are refused here, when the list is first seen) and split them into steps."""
        groups: dict[np.dtype, list[np.ndarray]] = {}
        for i, a in enumerate(arrays):
            validate(a, "grouped_allreduce")
            if not a.flags.writeable:
                raise ReadOnlyError("grouped_allreduce", rank,
                                    f"array {i} (shape {a.shape}, {a.dtype}) is read-only (e.g. "
                                    "np.frombuffer over bytes) and would receive the result in "
                                    "place; pass a writable copy")
            groups.setdefault(a.dtype, []).append(a)
        steps: list[Step] = []
        for dtype in sorted(groups, key=lambda d: d.str):  # same order on every rank
            steps += _split(groups[dtype], dtype, threshold)
        plan = Plan(tuple(steps), list(arrays), _sig.group_words(arrays, str(op), threshold), op)
        self.built += 1
        if cache:
            if len(self.cache) >= CACHED_PLANS:
                self.cache.pop(next(iter(self.cache))).free()
            self.cache[key] = plan
        return plan

    def clear(self) -> None:
        for plan in self.cache.values():
            plan.free()
        self.cache.clear()


def _split(arrays: list[np.ndarray], dtype: np.dtype, threshold: int) -> list[Step]:
    """Steps for same-dtype ``arrays``, in order: large ones alone, the rest in batches
    of at most ``min(threshold, SINGLE_STEP_MAX)`` bytes."""
    alone = min(threshold, FUSE_ALONE_BYTES)
    cap = min(threshold, SINGLE_STEP_MAX)
    steps: list[Step] = []
    batch: list[np.ndarray] = []
    nbytes = 0
    for a in arrays:
        if a.nbytes >= alone:
            steps.append(Alone(a))
            continue
        if nbytes + a.nbytes > cap:
            steps.append(_fused(batch, dtype))
            batch, nbytes = [], 0
        batch.append(a)
        nbytes += a.nbytes
    if batch:
        steps.append(_fused(batch, dtype))
    return steps


def _fused(batch: list[np.ndarray], dtype: np.dtype) -> Step:
    live = [a for a in batch if a.size]
    if len(live) <= 1:
        return Alone(live[0] if live else batch[0])
    addrs = [MPI.Get_address(a) for a in live]
    base = min(addrs)
    end = max(ad + a.nbytes for ad, a in zip(addrs, live))
    datatype = _dt.mpi_type(dtype).Create_hindexed(
        [a.size for a in live], [ad - base for ad in addrs]).Commit()
    if datatype.Get_extent()[1] != end - base:  # not expected; keep MPI honest
        datatype.Free()
        raise CollectiveError("grouped_allreduce", None, "internal: fused datatype "
                              "extent differs from the arrays' span")
    pairs = np.array([(ad, a.nbytes) for ad, a in zip(addrs, live)], dtype=np.int64)
    return Fused(datatype, MPI.buffer.fromaddress(base, end - base), dtype,
                 sum(a.size for a in live), pairs)


def run(c: Any, plan: Plan, op: Any, sig: tuple | None) -> None:
    """Reduce every step of ``plan`` over ``c``; ``sig`` (the list's signature, or None)
    rides in the first step's first exchange: once it matches, every rank has the same
    plan, so the later steps carry none."""
    if sig is not None and not plan.steps:  # nothing to reduce here: still compare
        c._sigs.light(sig, "grouped_allreduce")
    for step in plan.steps:
        if type(step) is Alone:
            c._allreduce(step.array, op, None, True, np, sig)
        else:
            _run_fused(c, step, op, sig)
        sig = None


def _run_fused(c: Any, step: Fused, op: Any, sig: tuple | None) -> None:
    shm = c._shm
    path = c._paths.pick(step.nbytes, True)[0] if shm is not None else "mpi"
    if path != "mpi" and c._engine_win is not None:
        # The compiled engine reduces the arrays where they are, as one stream (no
        # packing); False: a dtype or op it does not do (no rank synchronised).
        if c._engine.grouped(step.pairs, c._plans.rep(step.dtype), op, sig):
            return
    if path.startswith("shm") and step.nbytes <= SINGLE_STEP_MAX:
        # Pack straight into this rank's shared slot, unpack straight out of the
        # shared result: no intermediate fusion buffer at all.
        if sig is not None:
            c._sigs.light(sig, "grouped_allreduce")
        t, mop, kern, finish, _, _ = c._redop(c._plans.rep(step.dtype), op, "grouped_allreduce")
        shm.allreduce_packed(step.count, step.dtype, step.pack, step.unpack, kern, t, mop,
                             finish, c._cross_ring if path == "shm+ring" else None)
        return
    flat = c._plans.buffer(step.dtype, step.count)
    step.pack(flat)
    c._allreduce(flat, op, None, True, np, sig)
    step.unpack(flat)
