"""Data-parallel training for PyTorch on dtrun's collectives runtime.

What Horovod gives a training script, in four lines::

    import dtrun.collectives.dp as dp
    ctx = dp.init()                                   # rank, size, local_rank, device
    dp.broadcast_parameters(model, root=0)            # everyone starts from rank 0's weights
    opt = dp.DistributedOptimizer(opt, named_parameters=model.named_parameters())

``DistributedOptimizer`` averages gradients across ranks before ``step()``. Gradients
are copied into buckets (flat buffers of a few MiB, parameters in reverse order of
registration, as the backward pass produces them) from a hook that fires as soon as
each parameter's gradient is accumulated; a full bucket is handed to one background
thread that allreduces it (shared memory within a host, MPI between hosts, NCCL on
GPUs) while the backward pass goes on. Buckets are reduced in the same order on every
rank; ``step()`` only waits for what is still in flight.

A parameter that gets no gradient on some ranks does not hang the job: at
``synchronize()`` the missing part of its bucket is filled with zeros, and one extra
element per parameter (1 where this rank had a gradient) rides in the same allreduce,
so a parameter no rank touched keeps ``grad=None`` everywhere, as in plain PyTorch.

Importing this module imports torch and, on first use, MPI.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch

from . import checkpoint as _checkpoint
from . import objects as _objects
from ._queries import query
from .checkpoint import CheckpointError  # noqa: F401 (collectives.dp.CheckpointError)
from .checkpoint import to_cpu as _to_cpu
from .errors import CollectiveError, MismatchError

AVG, SUM = "avg", "sum"
# Horovod's warning, which Horovod users' tests look for (the gradients are not averaged
# again here: Horovod's optimizer reduces them a second time).
_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(): the gradients are averaged already; call step() inside "
    "`with optimizer.skip_synchronize():` after an explicit synchronize()")
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


class NotInitializedError(CollectiveError, RuntimeError):
    """A collectives.dp function was called before ``init()``."""


class ParameterMismatchError(MismatchError):
    """The ranks built different parameter sets (names, shapes or dtypes)."""


class UsageError(CollectiveError, ValueError):
    """An argument of a collectives.dp function that cannot work (checked locally)."""


class Compression:
    """How gradients travel: ``none`` (as they are) or ``fp16`` (float32/64 sent as
    float16, halving the bytes; restored to the parameter's dtype afterwards)."""

    none = "none"
    fp16 = "fp16"


@dataclass(frozen=True)
class Context:
    """What ``init()`` returns: this rank's place in the job and its device."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    comm: Any  # collectives.Comm


_CTX: Context | None = None
# One thread at a time inside the runtime: the optimizer's background thread holds it
# for each bucket, the functions below for their collectives. Comm objects keep
# per-call state (the shared-memory window), so two threads must not share one at once.
_LOCK = threading.RLock()


def init(comm: Any = None) -> Context:
    """Start (or join) the job; return rank, size, local rank and this rank's device.

    The device is ``cuda:{local_rank % device_count}`` when CUDA is available (made
    current with ``torch.cuda.set_device``), else ``cpu``. Calling it again returns
    the same context. Collective on first call.
    """
    global _CTX
    if _CTX is not None:
        return _CTX
    if comm is None:
        import os
        import sys

        ours = "mpi4py.MPI" not in sys.modules and "OMPI_MCA_mpi_yield_when_idle" not in os.environ
        if ours:
            # Open MPI busy-polls while it waits. Here the allreduce thread waits beside
            # the compute threads (and, on a host with more ranks than free cores, other
            # ranks): a waiting rank should give its core away, or it slows the very
            # threads it waits for (benchmarks/bench_ddp.py measures both settings on a
            # loaded host). Read at MPI_Init (importing mpi4py.MPI); a user's setting wins.
            os.environ["OMPI_MCA_mpi_yield_when_idle"] = "1"
        try:
            from . import comm as _comm
            comm = _comm.init()
        finally:
            if ours:
                os.environ.pop("OMPI_MCA_mpi_yield_when_idle", None)  # not for child processes
    device = torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    _CTX = Context(comm.rank, comm.size, comm.local_rank, comm.local_size, device, comm)
    return _CTX


def _ctx(op: str) -> Context:
    if _CTX is None:
        raise NotInitializedError(op, None, "called before init(); call collectives.dp.init() "
                                  "first (once per process, after the launcher started it)")
    return _CTX


rank = query(_ctx, "rank", "This process's rank.")
size = query(_ctx, "size", "Number of ranks in the job.")
local_rank = query(_ctx, "local_rank", "This process's rank among the ranks on its host.")


# ---------------------------------------------------------------- broadcasts
def broadcast_object(obj: Any, root: int = 0) -> Any:
    """Root's ``obj`` (any picklable object: an epoch counter, a config) on every rank."""
    return _objects.broadcast_object(_ctx("broadcast_object").comm, obj, root, lock=_LOCK)


def _allgather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    return _objects.allgather_objects(_ctx("allgather").comm, obj, lock=_LOCK)


def _named_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.nn.Module):
        return list(obj.state_dict(keep_vars=True).items())
    if isinstance(obj, Mapping):
        return list(obj.items())
    items = list(obj)
    if items and isinstance(items[0], tuple):
        return [(str(k), v) for k, v in items]
    return [(f"tensor.{i}", t) for i, t in enumerate(items)]


def broadcast_parameters(params: Any, root: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with root's, in place.

    ``params``: a module (its ``state_dict``: parameters and buffers), a state dict,
    ``model.named_parameters()``, or a list of tensors. Every rank must pass the same
    names and shapes (checked; raises ParameterMismatchError naming the first difference).
    """
    ctx = _ctx("broadcast_parameters")
    named = [(k, v) for k, v in _named_tensors(params) if torch.is_tensor(v)]
    _check_same(named, "broadcast_parameters")
    with _LOCK, torch.no_grad():
        for _, t in named:
            if t.numel() == 0:
                continue
            data = t.data if t.is_contiguous() else t.data.contiguous()
            ctx.comm.broadcast(data, root=root, inplace=True)
            if data is not t.data:
                t.data.copy_(data)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0) -> None:
    """Give every rank root's optimizer state (momentum buffers, Adam moments, step
    counts, learning rates), e.g. after root alone loaded a checkpoint."""
    ctx = _ctx("broadcast_optimizer_state")
    state = _to_cpu(optimizer.state_dict()) if ctx.rank == root else None
    state = broadcast_object(state, root=root)
    if ctx.rank != root:
        optimizer.load_state_dict(state)  # casts tensors to each parameter's device


# ---------------------------------------------------------------- checkpoints
def save_checkpoint(path: str, state: Any) -> None:
    """Write ``state`` to ``path`` from rank 0; every rank returns once it is on disk.

    Atomic and safe in a shared directory: rank 0 creates a temporary file of its own beside
    ``path`` (an unpredictable name, mode 0600, never through a symbolic link), writes a
    sha256 header and ``torch.save``'s bytes, flushes it to disk and renames it over
    ``path``, so a job killed mid-write leaves the previous checkpoint whole. Any failure on
    rank 0 (a full disk, an object that cannot be pickled) raises the same CheckpointError
    (an OSError) on every rank. Collective.
    """
    _checkpoint.save(_ctx("save_checkpoint").comm, path, state, lock=_LOCK)


def load_checkpoint(path: str, trusted: bool = False) -> Any:
    """The state last saved at ``path`` on every rank, or None when there is none (a first run).

    Rank 0 reads the file and sends it to the others, so it need not be on a file system
    every host shares. The path must be a regular file (not a symbolic link) owned by this
    user or root; its checksum is checked. Tensors, numbers, strings and plain containers
    load (``torch.load(weights_only=True)``). ``trusted=True`` loads any pickled object, which
    RUNS ARBITRARY CODE from the file: use it only for a file that only you can write. Any
    failure raises the same CheckpointError (an OSError) on every rank. Collective.
    """
    return _checkpoint.load(_ctx("load_checkpoint").comm, path, trusted=trusted, lock=_LOCK)


# ---------------------------------------------------------------- metrics and data
def allreduce_metric(value: Any, op: str = AVG) -> Any:
    """Reduce a loss or accuracy over ranks (avg, sum, min, max).

    A Python number gives a float; a tensor gives a tensor (a reduced copy).
    """
    ctx = _ctx("allreduce_metric")
    if torch.is_tensor(value):
        t = value.detach().to(torch.float64 if not value.is_floating_point() else value.dtype)
        t = t.contiguous().clone()
        with _LOCK:
            ctx.comm.allreduce(t, op=op, inplace=True)
        return t
    a = np.array([float(value)], dtype=np.float64)
    with _LOCK:
        ctx.comm.allreduce(a, op=op, inplace=True)
    return float(a[0])


def shard(n_items: int, seed: int = 0, shuffle: bool = True, even: bool = True,
          rank: int | None = None, size: int | None = None) -> np.ndarray:
    """This rank's indices into a dataset of ``n_items``.

    The items are permuted with ``seed`` (the same permutation on every rank, and
    every time for that seed), then dealt round-robin: rank r gets positions r,
    r+size, ... . Together the ranks cover every item. With ``even`` (the default,
    as torch's DistributedSampler), the first few items are dealt again so that every
    rank gets ceil(n_items / size) and runs the same number of steps: a rank with
    one batch fewer would leave the others waiting in an allreduce.
    """
    if rank is None or size is None:
        ctx = _ctx("shard")
        rank = ctx.rank if rank is None else rank
        size = ctx.size if size is None else size
    if n_items < 0 or size < 1 or not 0 <= rank < size:
        raise UsageError("shard", rank, f"n_items={n_items}, rank={rank}, size={size} out of range")
    order = np.random.default_rng(seed).permutation(n_items) if shuffle else np.arange(n_items)
    if even and n_items and n_items % size:
        per_rank = -(-n_items // size)
        order = np.concatenate([order, order[:per_rank * size - n_items]])
    return order[rank::size]


class ShardSampler(torch.utils.data.Sampler):
    """A DataLoader sampler over ``shard()``: this rank's part of ``dataset``.

    The partition is fixed by ``seed``; ``set_epoch(e)`` reshuffles with seed + e
    (call it every epoch for a new order, or never for the same one).
    """

    def __init__(self, dataset: Any, seed: int = 0, shuffle: bool = True, even: bool = True):
        self.n_items = len(dataset)
        self.seed, self.shuffle, self.even, self.epoch = seed, shuffle, even, 0
        self._indices()  # fail early if init() was not called

    def _indices(self) -> np.ndarray:
        return shard(self.n_items, self.seed + self.epoch, self.shuffle, self.even)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices().tolist())

    def __len__(self) -> int:
        return len(self._indices())


# ---------------------------------------------------------------- parameter checks
def _signature(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple, str]]:
    return [(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in named]


def _check_same(named: list[tuple[str, torch.Tensor]], op: str) -> None:
    """Raise ParameterMismatchError on every rank if the ranks' tensor lists differ."""
    ctx = _ctx(op)
    if ctx.size == 1:
        return
    mine = _signature(named)
    tables = _allgather_objects(mine)
    problem = _first_difference(tables)
    if problem:
        raise ParameterMismatchError(op, ctx.rank, problem + "; every rank must build the same "
                                     "model and pass the same parameters")


def _first_difference(tables: list[list[tuple[str, tuple, str]]]) -> str | None:
    """Describe the first way any rank's (name, shape, dtype) list differs from rank 0's."""
    ref = tables[0]
    ref_by_name = {name: (shape, dtype) for name, shape, dtype in ref}
    for r, table in enumerate(tables[1:], start=1):
        by_name = {name: (shape, dtype) for name, shape, dtype in table}
        for name, shape, dtype in table:
            if name not in ref_by_name:
                return f"parameter {name!r} exists on rank {r} but not on rank 0"
            rshape, rdtype = ref_by_name[name]
            if shape != rshape:
                return (f"parameter {name!r} has shape {shape} on rank {r} but {rshape} "
                        "on rank 0")
            if dtype != rdtype:
                return f"parameter {name!r} is {dtype} on rank {r} but {rdtype} on rank 0"
        for name, _, _ in ref:
            if name not in by_name:
                return f"parameter {name!r} exists on rank 0 but not on rank {r}"
        if [n for n, _, _ in table] != [n for n, _, _ in ref]:
            return f"parameters are in a different order on rank {r} than on rank 0"
    return None


# ---------------------------------------------------------------- the optimizer
class _Slot:
    __slots__ = ("name", "param", "bucket", "index", "offset", "numel", "passes", "ready",
                 "hook_owner", "sparse", "gathered")

    def __init__(self, name: str, param: torch.Tensor):
        self.name, self.param = name, param
        self.bucket: _Bucket | None = None
        self.index = self.offset = self.numel = 0
        self.passes, self.ready = 0, False
        self.sparse: torch.Tensor | None = None  # this step's sparse gradient, to gather
        self.gathered = False  # the last synchronize() gathered this gradient (sparse)


class _Bucket:
    """Gradients of several parameters in one flat buffer, plus two flags per
    parameter at the end: 1 where this rank had a dense gradient, then 1 where it had a
    sparse gradient to gather (nonzero after the reduction: some rank had one)."""

    def __init__(self, index: int, slots: list[_Slot], dtype: torch.dtype, device: torch.device):
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


class _Worker:
    """The background thread that allreduces buckets in the order they are queued.

    One per process, shared by every DistributedOptimizer: a single queue keeps the
    order of collectives the same on every rank even when two optimizers' buckets
    are ready in the same backward pass (two threads would interleave them by chance).
    """

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="dtrun-dp-allreduce", daemon=True)
        self._thread.start()

    def submit(self, run, bucket: _Bucket) -> None:
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


_WORKER: _Worker | None = None


def _worker() -> _Worker:
    global _WORKER
    if _WORKER is None:
        _WORKER = _Worker()
    return _WORKER


_EXCHANGES: dict[int, Any] = {}


def _exchange(ctx: Context, buckets: list[_Bucket]):
    """The job's HostExchange when buckets should cross hosts on the ring (collective;
    one per communicator, shared by every DistributedOptimizer), else None."""
    from . import dp_exchange

    cpu = all(b.flat.device.type == "cpu" for b in buckets)
    try:
        if not dp_exchange.wanted(ctx.comm, cpu):
            return None
    except ValueError as e:
        raise _usage(ctx, str(e)) from None
    key = id(ctx.comm)
    if key not in _EXCHANGES:
        _EXCHANGES[key] = dp_exchange.open_exchange(ctx.comm, _torch_add, _torch_scale,
                                                     _torch_copy)
    return _EXCHANGES[key]


def _torch_add(dst: np.ndarray, src: np.ndarray) -> None:
    # torch's CPU kernels: vectorised for float16 too (NumPy's float16 add is ~25x slower),
    # and they release the GIL, so backward runs on while a chunk is summed.
    torch.from_numpy(dst).add_(torch.from_numpy(src))


def _torch_scale(x: np.ndarray, factor: float) -> None:
    torch.from_numpy(x).mul_(factor)


def _torch_copy(dst: np.ndarray, src: np.ndarray) -> None:
    torch.from_numpy(dst).copy_(torch.from_numpy(src))  # with a dtype conversion


def _usage(ctx: Context, problem: str) -> UsageError:
    return UsageError("DistributedOptimizer", ctx.rank, problem)


class _DistributedOptimizer:
    """Methods mixed into a copy of the user's optimizer (see DistributedOptimizer)."""

    def _dp_setup(self, named_parameters, op, backward_passes_per_step, compression,
                  bucket_bytes, overlap, sparse_as_dense) -> None:
        ctx = _ctx("DistributedOptimizer")
        if op not in (AVG, SUM):
            raise _usage(ctx, f"op={op!r}; use 'avg' or 'sum'")
        if compression not in (Compression.none, Compression.fp16):
            raise _usage(ctx, f"compression={compression!r}; use "
                             "Compression.none or Compression.fp16")
        if int(backward_passes_per_step) < 1:
            raise _usage(ctx, "backward_passes_per_step must be >= 1")
        self._dp_ctx = ctx
        self._dp_op, self._dp_k = op, int(backward_passes_per_step)
        self._dp_sparse_as_dense = bool(sparse_as_dense)
        self._dp_compression = compression
        in_opt = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(in_opt)]
        else:
            named = list(named_parameters)
            if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
                raise _usage(ctx, "named_parameters must be (name, "
                                 "parameter) pairs, e.g. model.named_parameters()")
            names = [n for n, _ in named]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise _usage(ctx, f"parameter names repeat: {dup[:5]}")
            known = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(in_opt) if id(p) not in known]
            if missing:
                raise _usage(ctx, f"{len(missing)} parameters of the "
                                 "optimizer are not in named_parameters; pass "
                                 "model.named_parameters() of the model being trained")
            ids = {id(p) for p in in_opt}
            named = [(n, p) for n, p in named if id(p) in ids]
        named = [(n, p) for n, p in named if p.requires_grad]
        _check_same(named, "DistributedOptimizer")
        for n, p in named:
            if p.is_sparse:
                raise _usage(ctx, f"parameter {n!r} is sparse; "
                                 "sparse gradients are not supported")
        self._dp_slots = [_Slot(n, p) for n, p in named]
        self._dp_buckets = self._dp_make_buckets(int(bucket_bytes))
        self._dp_next = 0  # first bucket not yet handed to the worker
        self._dp_in_flight: list[_Bucket] = []
        self._dp_synchronized = False
        self._dp_skip = False
        from mpi4py import MPI
        threads_ok = MPI.Query_thread() >= MPI.THREAD_SERIALIZED
        self._dp_overlap = bool(overlap) and threads_ok and ctx.size > 1
        self._dp_worker = _worker() if self._dp_overlap else None
        self._dp_hosts = _exchange(ctx, self._dp_buckets)
        self.transport = "ring" if self._dp_hosts is not None else "runtime"
        self._dp_hooks = [self._dp_register(s) for s in self._dp_slots] if ctx.size > 1 else []

    def _dp_make_buckets(self, cap: int) -> list[_Bucket]:
        # Reverse order of registration: the backward pass produces the last layer's
        # gradients first (PyTorch DDP's heuristic). One dtype and device per bucket.
        buckets: list[_Bucket] = []
        open_: dict[tuple, list[_Slot]] = {}
        sizes: dict[tuple, int] = {}
        order: list[tuple[tuple, list[_Slot]]] = []
        for s in reversed(self._dp_slots):
            dtype = self._dp_wire_dtype(s.param.dtype)
            key = (dtype, s.param.device)
            if key not in open_:
                open_[key], sizes[key] = [], 0
                order.append((key, open_[key]))
            open_[key].append(s)
            sizes[key] += s.param.numel() * s.param.element_size()
            if sizes[key] >= cap:
                del open_[key]
        for key, slots in order:
            buckets.append(_Bucket(len(buckets), slots, key[0], key[1]))
        return buckets

    def _dp_wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self._dp_compression == Compression.fp16 and dtype in (torch.float32, torch.float64):
            return torch.float16
        return dtype

    def _dp_register(self, slot: _Slot):
        hook = lambda *_: self._dp_on_grad(slot)  # noqa: E731
        p = slot.param
        if hasattr(p, "register_post_accumulate_grad_hook"):
            return p.register_post_accumulate_grad_hook(hook)
        # Older PyTorch: a hook on the parameter's gradient accumulator (Horovod's way).
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        slot.hook_owner = acc  # keep the accumulator alive
        return acc.register_hook(hook)

    # -- during backward
    def _dp_on_grad(self, slot: _Slot) -> None:
        slot.passes += 1
        if slot.passes < self._dp_k:
            return
        if slot.ready:
            raise CollectiveError(
                "DistributedOptimizer", self._dp_ctx.rank,
                f"parameter {slot.name!r} got a gradient more than backward_passes_per_step="
                f"{self._dp_k} times before step(); call step() after every {self._dp_k} "
                "backward passes, or raise backward_passes_per_step")
        self._dp_fill(slot)
        bucket = slot.bucket
        bucket.pending -= 1
        if bucket.pending == 0:
            self._dp_launch_ready()

    def _dp_fill(self, slot: _Slot) -> None:
        """Copy this rank's gradient (or zeros, if it has none) into the bucket. A sparse
        gradient goes in dense (``sparse_as_dense``) or is kept aside to be gathered."""
        b = slot.bucket
        view = b.flat[slot.offset:slot.offset + slot.numel]
        g = slot.param.grad
        slot.sparse = None
        if g is None or (g.is_sparse and not self._dp_sparse_as_dense):
            view.zero_()
            b.flags[slot.index] = 0
            if g is not None:
                slot.sparse = g
                b.sparse_flags[slot.index] = 1
        else:
            if g.is_sparse:
                g = g.to_dense()
            view.copy_(g.reshape(-1))
            b.flags[slot.index] = 1
        slot.ready = True

    def _dp_launch_ready(self) -> None:
        """Hand complete buckets to the worker, strictly in bucket order (so every
        rank issues the same sequence of allreduces)."""
        buckets = self._dp_buckets
        while self._dp_next < len(buckets) and buckets[self._dp_next].pending == 0:
            b = buckets[self._dp_next]
            self._dp_next += 1
            if self._dp_worker is None:
                continue  # no overlap: reduced in synchronize()
            if self._dp_hosts is not None and not self._dp_hosts.local:
                self._dp_in_flight.append(b)
                self._dp_start(b)  # cheap: queued for the ring's threads
                b.done.set()
                continue
            if b.flat.is_cuda:
                b.event = torch.cuda.Event()
                b.event.record()
            self._dp_in_flight.append(b)
            self._dp_worker.submit(self._dp_start if self._dp_hosts else self._dp_reduce, b)

    # -- the allreduce of one bucket (background thread, or synchronize())
    def _dp_reduce(self, b: _Bucket) -> None:
        if b.flat.is_cuda:
            # A new thread starts on device 0: use the bucket's device (and its
            # current stream, which NCCL orders the allreduce on).
            with torch.cuda.device(b.flat.device):
                if b.event is not None:
                    b.event.synchronize()
                self._dp_reduce_current(b)
                torch.cuda.current_stream(b.flat.device).synchronize()
            return
        self._dp_reduce_current(b)

    def _dp_reduce_current(self, b: _Bucket) -> None:
        comm = self._dp_ctx.comm
        with _LOCK:
            comm.allreduce(b.buffer, op=self._dp_op, inplace=True)
        self._dp_unpack(b)

    def _dp_start(self, b: _Bucket) -> None:
        """Across hosts: sum within the host and hand the bucket to the ring."""
        scale = 1.0 / self._dp_ctx.size if self._dp_op == AVG else None
        with _LOCK:
            comm = self._dp_ctx.comm
            if comm._rec is not None:  # the flight recorder counts it like any allreduce
                comm._note("allreduce", b.buffer, self._dp_op)
            b.job = self._dp_hosts.start(b.buffer, scale)

    def _dp_finish(self, buckets: list[_Bucket]) -> None:
        for b in buckets:
            with _LOCK:
                self._dp_hosts.wait(b.job, b.buffer)
            self._dp_unpack(b)

    def _dp_unpack(self, b: _Bucket) -> None:
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

    # -- public
    def synchronize(self) -> None:
        """Finish averaging the gradients now (e.g. before clipping them).

        Buckets not complete yet (parameters without a gradient on this rank, or
        fewer backward passes than ``backward_passes_per_step``) are completed from
        ``.grad`` or zeros and reduced; then this waits for everything in flight.
        """
        if self._dp_ctx.size == 1:
            self._dp_synchronized = True
            return
        for b in self._dp_buckets[self._dp_next:]:
            for s in b.slots:
                if not s.ready:
                    self._dp_fill(s)
            b.pending = 0
        self._dp_launch_ready()
        try:
            self._dp_wait_all()
            self._dp_gather_sparse()
        finally:
            self._dp_in_flight.clear()
            self._dp_reset()
        self._dp_synchronized = True

    def _dp_gather_sparse(self) -> None:
        """Reduce the sparse gradients kept aside (``sparse_as_dense=False``) as Horovod's
        sparse allreduce does: every rank's indices and values gathered into one sparse
        gradient (its duplicates sum when it is coalesced), the values divided by the size
        for op avg. A parameter some rank had a dense gradient for gets the sum of both."""
        todo = []
        for b in self._dp_buckets:
            sparse, dense = b.sparse_flags.tolist(), b.flags.tolist()
            for s in b.slots:
                s.gathered = sparse[s.index] != 0
                if s.gathered:
                    todo.append((s, dense[s.index] != 0))
        if not todo:
            return
        metas = _allgather_objects([None if s.sparse is None else s.sparse.sparse_dim()
                                    for s, _ in todo])
        for i, (s, mixed) in enumerate(todo):
            dims = next(m[i] for m in metas if m[i] is not None)
            self._dp_gather_one(s, dims, mixed)
            s.sparse = None

    def _dp_gather_one(self, s: _Slot, sparse_dim: int, mixed: bool) -> None:
        p, ctx = s.param, self._dp_ctx
        if s.sparse is None:  # no sparse gradient here: this rank adds no rows
            dtype = p.grad.dtype if p.grad is not None else p.dtype
            idx = torch.zeros((0, sparse_dim), dtype=torch.int64)
            val = torch.zeros((0,) + tuple(p.shape[sparse_dim:]), dtype=dtype)
        else:
            idx = s.sparse._indices().t().contiguous().cpu()
            val = s.sparse._values().contiguous().cpu()
        bf16 = val.dtype == torch.bfloat16  # MPI moves its bits
        with _LOCK:
            gi = ctx.comm.allgatherv(idx.numpy())
            gv = ctx.comm.allgatherv((val.view(torch.int16) if bf16 else val).numpy())
        values = torch.from_numpy(gv)
        values = (values.view(torch.bfloat16) if bf16 else values).to(p.device)
        if self._dp_op == AVG:
            values = values / ctx.size
        result = torch.sparse_coo_tensor(torch.from_numpy(gi).t().to(p.device), values, p.shape,
                                         check_invariants=False)
        with torch.no_grad():
            if mixed:  # the dense part was reduced in the bucket: add the two
                both = p.grad.to_dense() + result.to_dense()
                p.grad = both.to_sparse(sparse_dim) if p.grad.is_sparse else both
            else:
                p.grad = result

    def _dp_wait_all(self) -> None:
        if self._dp_worker is None:
            if self._dp_hosts is not None:  # all handed to the ring first, then waited on
                for b in self._dp_buckets:
                    self._dp_start(b)
                self._dp_finish(self._dp_buckets)
                return
            for b in self._dp_buckets:
                self._dp_reduce(b)
            return
        for b in self._dp_in_flight:
            b.done.wait()
        errors = [b.error for b in self._dp_in_flight if b.error is not None]
        if errors:
            raise errors[0]
        if self._dp_hosts is not None:
            self._dp_finish(self._dp_in_flight)

    def _dp_reset(self) -> None:
        for b in self._dp_buckets:
            b.reset()
            b.event = b.error = b.job = None
        self._dp_next = 0

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize again: for gradient
        clipping after an explicit ``synchronize()``."""
        self._dp_skip = True
        try:
            yield
        finally:
            self._dp_skip = False

    def step(self, closure=None):
        """Average gradients (waiting only for what is still in flight), then step."""
        if self._dp_skip:
            if not self._dp_synchronized:
                raise CollectiveError("DistributedOptimizer.step", self._dp_ctx.rank,
                                      "step() inside skip_synchronize() without a "
                                      "synchronize() since the last step; call "
                                      "optimizer.synchronize() first")
        elif not self._dp_synchronized:
            self.synchronize()
        else:
            warnings.warn(_STEP_AFTER_SYNCHRONIZE, stacklevel=2)
        self._dp_synchronized = False
        return super(self.__class__, self).step(closure) if closure is not None \
            else super(self.__class__, self).step()

    def remove_hooks(self) -> None:
        """Detach from the model: later backward passes are not averaged."""
        for h in self._dp_hooks:
            h.remove()
        self._dp_hooks = []


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 (Horovod's name)
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         op: str = AVG, backward_passes_per_step: int = 1,
                         compression: str = Compression.none,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         overlap: bool = True,
                         sparse_as_dense: bool = True) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    The result is an instance of the optimizer's own class (learning-rate schedulers
    accept it) sharing its parameter groups and state, with ``synchronize()``,
    ``skip_synchronize()`` and ``remove_hooks()`` added, and ``transport``: ``"ring"``
    when buckets cross hosts on dtrun's TCP ring (the job spans hosts and the gradients
    are on the CPU; ``DTRUN_DP_TRANSPORT=mpi`` turns it off), else ``"runtime"`` (the
    runtime's allreduce: shared memory, MPI, or NCCL on GPUs). Collective: every rank must
    call it with the same parameters (names, shapes, dtypes; checked).

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``; the names appear in errors
            (default: ``param.0``, ``param.1``, ... in the optimizer's order).
        op: ``"avg"`` (mean over ranks, the default) or ``"sum"``.
        backward_passes_per_step: backward passes accumulated locally before one
            allreduce (gradient accumulation; scale the loss by 1/k yourself).
        compression: ``Compression.none`` or ``Compression.fp16``.
        bucket_bytes: gradient bytes per allreduce bucket (default 4 MiB).
        overlap: allreduce buckets from a background thread during backward
            (default); False reduces everything in ``synchronize()``.
        sparse_as_dense: sparse gradients (``nn.Embedding(sparse=True)``) are reduced
            dense (default); False gathers every rank's indices and values instead
            (Horovod's sparse allreduce, cheaper for large, sparsely used embeddings).
            ``.grad`` stays sparse either way.

    Raises:
        NotInitializedError: ``init()`` was not called.
        ParameterMismatchError: the ranks' parameter sets differ (names the first
            difference and the rank).
    """
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in _DistributedOptimizer.__dict__.items()
                if k not in ("__dict__", "__weakref__")})
    dist = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)  # same param_groups and state objects
    dist._dp_setup(named_parameters, op, backward_passes_per_step, compression,
                   bucket_bytes, overlap, sparse_as_dense)
    return dist
