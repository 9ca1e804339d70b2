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

The parts live beside this module: ``dp_context`` (``init()``, the context and lock, the
errors), ``dp_optimizer`` (``DistributedOptimizer``), ``dp_buckets`` (the buckets and
their thread), ``dp_sparse`` (sparse gradients), ``dp_exchange`` (buckets across hosts).
This module holds the helpers a training script calls besides the optimizer.

Importing this module imports torch and, on first use, MPI.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import numpy as np
import torch

from . import checkpoint as _checkpoint
from . import objects as _objects
from .checkpoint import CheckpointError  # noqa: F401 (collectives.dp.CheckpointError)
from .checkpoint import to_cpu as _to_cpu
from .dp_context import (AVG, LOCK, SUM, Context, NotInitializedError,  # noqa: F401 (public here)
                         ParameterMismatchError, UsageError, check_same, current, init,
                         local_rank, rank, size)
from .dp_optimizer import (DEFAULT_BUCKET_BYTES, Compression,  # noqa: F401 (public here)
                           DistributedOptimizer)


# ---------------------------------------------------------------- broadcasts
def broadcast_object(obj: Any, root: int = 0) -> Any:
    """Root's ``obj`` (any picklable object: an epoch counter, a config) on every rank."""
    return _objects.broadcast_object(current("broadcast_object").comm, obj, root, lock=LOCK)


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
    ctx = current("broadcast_parameters")
    named = [(k, v) for k, v in _named_tensors(params) if torch.is_tensor(v)]
    check_same(named, "broadcast_parameters")
    with LOCK, torch.no_grad():
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
    ctx = current("broadcast_optimizer_state")
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
    _checkpoint.save(current("save_checkpoint").comm, path, state, lock=LOCK)


def load_checkpoint(path: str, trusted: bool = False) -> Any:
    """The state last saved at ``path`` on every rank, or None when there is none (a first run).

    Rank 0 reads the file and sends it to the others, so it need not be on a file system
    every host shares. The path must be a regular file (not a symbolic link) owned by this
    user or root; its checksum is checked. Tensors, numbers, strings and plain containers
    load (``torch.load(weights_only=True)``). ``trusted=True`` loads any pickled object, which
    RUNS ARBITRARY CODE from the file: use it only for a file that only you can write. Any
    failure raises the same CheckpointError (an OSError) on every rank. Collective.
    """
    return _checkpoint.load(current("load_checkpoint").comm, path, trusted=trusted, lock=LOCK)


# ---------------------------------------------------------------- metrics and data
def allreduce_metric(value: Any, op: str = AVG) -> Any:
    """Reduce a loss or accuracy over ranks (avg, sum, min, max).

    A Python number gives a float; a tensor gives a tensor (a reduced copy).
    """
    ctx = current("allreduce_metric")
    if torch.is_tensor(value):
        t = value.detach().to(torch.float64 if not value.is_floating_point() else value.dtype)
        t = t.contiguous().clone()
        with LOCK:
            ctx.comm.allreduce(t, op=op, inplace=True)
        return t
    a = np.array([float(value)], dtype=np.float64)
    with LOCK:
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
        ctx = current("shard")
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

