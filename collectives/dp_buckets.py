"""Gradient buckets: flat buffers that carry several parameters' gradients in one allreduce.

A ``Bucket`` holds the gradients of a few MiB of parameters of one dtype and device,
plus two flags per parameter (a dense gradient here; a sparse one to gather); ``Slot``
is one parameter's place in it. ``make_buckets`` packs parameters in reverse order of
registration, ``unpack`` copies the reduced bucket back into ``.grad`` (the optimizer's
``_dp_fill`` copies a gradient in). ``Worker`` is the one background thread that
reduces buckets in the order they are queued. Separate from the optimizer
(``dp_optimizer``), which decides when a bucket is full and where it is reduced.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch


class Slot:
    """One parameter's place in its bucket, and what this step did with its gradient."""

    __slots__ = ("name", "param", "bucket", "index", "offset", "numel", "passes", "ready",
                 "hook_owner", "sparse", "gathered")

    def __init__(self, name: str, param: torch.Tensor):
        self.name, self.param = name, param
        self.bucket: Bucket | None = None
        self.index = self.offset = self.numel = 0
        self.passes, self.ready = 0, False
        self.sparse: torch.Tensor | None = None  # this step's sparse gradient, to gather
        self.gathered = False  # the last synchronize() gathered this gradient (sparse)


class Bucket:
    """Gradients of several parameters in one flat buffer, plus two flags per
    parameter at the end: 1 where this rank had a dense gradient, then 1 where it had a
    sparse gradient to gather (nonzero after the reduction: some rank had one)."""

    def __init__(self, index: int, slots: list[Slot], dtype: torch.dtype, device: torch.device):
        self.index, self.slots = index, slots
        offset = 0
        for i, s in enumerate(slots):
            s.bucket, s.index, s.offset, s.numel = self, i, offset, s.param.numel()
            offset += s.numel
        self.flag_offset = offset
        n = len(slots)
        self.flat = torch.zeros(offset + 2 * n, dtype=dtype, device=device)
        self.flags = self.flat[offset:offset + n]
        self.sparse_flags = self.flat[offset + n:]
        # CPU: hand the runtime a NumPy view made once (its fastest path).
        self.buffer = self.flat.numpy() if device.type == "cpu" else self.flat
        self.pending = len(slots)
        self.done = threading.Event()
        self.event = None  # CUDA: marks the copies into ``flat`` on the producer's stream
        self.error: BaseException | None = None  # raised by the worker, re-raised at synchronize
        self.job = None  # across hosts: the ring's handle (dp_exchange)

    def reset(self) -> None:
        self.pending = len(self.slots)
        self.done.clear()
        self.sparse_flags.zero_()  # set again by the next fills that keep a sparse gradient
        for s in self.slots:
            s.passes, s.ready = 0, False


class Worker:
    """The background thread that allreduces buckets in the order they are queued.

    One per process, shared by every DistributedOptimizer: a single queue keeps the
    order of collectives the same on every rank even when two optimizers' buckets
    are ready in the same backward pass (two threads would interleave them by chance).
    """

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="dtrun-dp-allreduce", daemon=True)
        self._thread.start()

    def submit(self, run, bucket: Bucket) -> None:
        self._queue.put((run, bucket))

    def _loop(self) -> None:
        while True:
            run, bucket = self._queue.get()
            try:
                run(bucket)
            except BaseException as e:  # handed to the main thread at synchronize()
                bucket.error = e
            finally:
                bucket.done.set()


_WORKER: Worker | None = None


def worker() -> Worker:
    """The process's one bucket thread (started on first use)."""
    global _WORKER
    if _WORKER is None:
        _WORKER = Worker()
    return _WORKER


def make_buckets(slots: list[Slot], cap: int,
                 wire_dtype: Callable[[torch.dtype], torch.dtype]) -> list[Bucket]:
    """``slots`` packed into buckets of about ``cap`` bytes, each of one dtype (the
    parameter's as ``wire_dtype`` maps it) and one device."""
    # Reverse order of registration: the backward pass produces the last layer's
    # gradients first (PyTorch DDP's heuristic). One dtype and device per bucket.
    buckets: list[Bucket] = []
    open_: dict[tuple, list[Slot]] = {}
    sizes: dict[tuple, int] = {}
    order: list[tuple[tuple, list[Slot]]] = []
    for s in reversed(slots):
        dtype = wire_dtype(s.param.dtype)
        key = (dtype, s.param.device)
        if key not in open_:
            open_[key], sizes[key] = [], 0
            order.append((key, open_[key]))
        open_[key].append(s)
        sizes[key] += s.param.numel() * s.param.element_size()
        if sizes[key] >= cap:
            del open_[key]
    for key, members in order:
        buckets.append(Bucket(len(buckets), members, key[0], key[1]))
    return buckets


def unpack(b: Bucket) -> None:
    """Copy a reduced bucket into the parameters' ``.grad``."""
    with torch.no_grad():
        flags = b.flags.tolist()
        for s in b.slots:
            if flags[s.index] == 0:
                continue  # no rank had a gradient: grad stays None everywhere
            p = s.param
            view = b.flat[s.offset:s.offset + s.numel].view(p.shape)
            if p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            elif p.grad.is_sparse:  # reduced dense (sparse_as_dense): sparse again
                p.grad = view.to(p.dtype, copy=True).to_sparse(p.grad.sparse_dim())
            else:
                p.grad.copy_(view)
