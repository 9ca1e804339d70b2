"""``DistributedOptimizer``: the user's optimizer, with gradients averaged over ranks.

The optimizer registers a hook per parameter; as the backward pass accumulates each
gradient the hook copies it into its bucket (``dp_buckets``), and a complete bucket is
handed, in bucket order, to the background thread (or, across hosts, to the TCP ring of
``dp_exchange``) while the backward pass goes on. ``synchronize()`` completes what is
missing (parameters without a gradient here get zeros), waits for what is in flight and
gathers sparse gradients (``dp_sparse``); ``step()`` synchronizes and steps. The module
doc of ``collectives.dp`` says what a training script sees.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterable

import numpy as np
import torch
import torch.optim.optimizer as _optim

from . import dp_exchange
from .dp_buckets import Bucket, Slot, make_buckets, unpack, worker
from .dp_context import AVG, LOCK, SUM, Context, UsageError, check_same, current
from .dp_sparse import gather_sparse
from .errors import CollectiveError

# Horovod's warning, which Horovod users' tests look for (the gradients are not averaged
# again here: Horovod's optimizer reduces them a second time).
_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(): the gradients are averaged already; call step() inside "
    "`with optimizer.skip_synchronize():` after an explicit synchronize()")
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


class Compression:
    """How gradients travel: ``none`` (as they are) or ``fp16`` (float32/64 sent as
    float16, halving the bytes; restored to the parameter's dtype afterwards)."""

    none = "none"
    fp16 = "fp16"


_EXCHANGES: dict[int, Any] = {}


def _exchange(ctx: Context, buckets: list[Bucket]):
    """The job's HostExchange when buckets should cross hosts on the ring (collective;
    one per communicator, shared by every DistributedOptimizer), else None."""
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
        ctx = current("DistributedOptimizer")
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
        check_same(named, "DistributedOptimizer")
        for n, p in named:
            if p.is_sparse:
                raise _usage(ctx, f"parameter {n!r} is sparse; "
                                 "sparse gradients are not supported")
        self._dp_slots = [Slot(n, p) for n, p in named]
        self._dp_buckets = make_buckets(self._dp_slots, int(bucket_bytes), self._dp_wire_dtype)
        self._dp_next = 0  # first bucket not yet handed to the worker
        self._dp_in_flight: list[Bucket] = []
        self._dp_synchronized = False
        self._dp_skip = False
        from mpi4py import MPI
        threads_ok = MPI.Query_thread() >= MPI.THREAD_SERIALIZED
        self._dp_overlap = bool(overlap) and threads_ok and ctx.size > 1
        self._dp_worker = worker() if self._dp_overlap else None
        self._dp_hosts = _exchange(ctx, self._dp_buckets)
        self.transport = "ring" if self._dp_hosts is not None else "runtime"
        self._dp_hooks = [self._dp_register(s) for s in self._dp_slots] if ctx.size > 1 else []

    def _dp_wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self._dp_compression == Compression.fp16 and dtype in (torch.float32, torch.float64):
            return torch.float16
        return dtype

    def _dp_register(self, slot: Slot):
        hook = lambda *_: self._dp_on_grad(slot)  # noqa: E731
        p = slot.param
        if hasattr(p, "register_post_accumulate_grad_hook"):
            return p.register_post_accumulate_grad_hook(hook)
        # Older PyTorch: a hook on the parameter's gradient accumulator (Horovod's way).
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        slot.hook_owner = acc  # keep the accumulator alive
        return acc.register_hook(hook)

    # -- during backward
    def _dp_on_grad(self, slot: Slot) -> None:
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

    def _dp_fill(self, slot: Slot) -> None:
        """Copy this rank's gradient (or zeros, if it has none) into the bucket. A sparse
        gradient goes in dense (``sparse_as_dense``) or is kept aside to be gathered.
        The Horovod adapter wraps it per instance (gradient_predivide_factor)."""
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
    def _dp_reduce(self, b: Bucket) -> None:
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

    def _dp_reduce_current(self, b: Bucket) -> None:
        comm = self._dp_ctx.comm
        with LOCK:
            comm.allreduce(b.buffer, op=self._dp_op, inplace=True)
        unpack(b)

    def _dp_start(self, b: Bucket) -> None:
        """Across hosts: sum within the host and hand the bucket to the ring."""
        scale = 1.0 / self._dp_ctx.size if self._dp_op == AVG else None
        with LOCK:
            comm = self._dp_ctx.comm
            if comm._rec is not None:  # the flight recorder counts it like any allreduce
                comm._note("allreduce", b.buffer, self._dp_op)
            b.job = self._dp_hosts.start(b.buffer, scale)

    def _dp_finish(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            with LOCK:
                self._dp_hosts.wait(b.job, b.buffer)
            unpack(b)

    # -- public
    def synchronize(self) -> None:
        """Finish averaging the gradients now (e.g. before clipping them).

        Buckets not complete yet (parameters without a gradient on this rank, or
        fewer backward passes than ``backward_passes_per_step``) are completed from
        ``.grad`` or zeros and reduced; then this waits for everything in flight.
        """
        self._dp_sync(None)

    def _dp_sync(self, step_each) -> None:
        """``synchronize()``; with ``step_each``, also the optimizer's step of each
        bucket's parameters as soon as that bucket is averaged (``_StepEach``)."""
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
            waits = self._dp_wait_all()
            try:
                for b in waits:
                    if step_each is not None:
                        step_each.bucket(b)
            except BaseException:
                _drain(waits)
                raise
            gather_sparse(self._dp_buckets, self._dp_ctx, self._dp_op)
            if step_each is not None:
                step_each.rest()
        finally:
            self._dp_in_flight.clear()
            self._dp_reset()
        self._dp_synchronized = True

    def _dp_wait_all(self):
        """Each bucket once it is averaged into ``.grad``, in bucket order (a generator:
        run it to the end)."""
        if self._dp_worker is None:
            if self._dp_hosts is not None:  # all handed to the ring first, then waited on
                for b in self._dp_buckets:
                    self._dp_start(b)
                self._dp_finish(self._dp_buckets)
                return
            for b in self._dp_buckets:
                self._dp_reduce(b)
            return
        flight = self._dp_in_flight
        if self._dp_hosts is not None and self._dp_hosts.local:
            # The worker's host-level sums must all be issued before the first host-level
            # broadcast in _dp_finish, so that every rank of the host calls them in one order.
            for b in flight:
                b.done.wait()
        for b in flight:
            b.done.wait()
            if b.error is not None:
                for rest in flight:  # nothing of this step may still run when it is reset
                    rest.done.wait()
                raise b.error
            if self._dp_hosts is not None:
                self._dp_finish([b])
            yield b

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
            if closure is None and self._dp_steps_each():
                self._dp_sync(_StepEach(self))
                self._dp_synchronized = False
                return None
            self.synchronize()
        else:
            warnings.warn(_STEP_AFTER_SYNCHRONIZE, stacklevel=2)
        self._dp_synchronized = False
        return super(self.__class__, self).step(closure) if closure is not None \
            else super(self.__class__, self).step()

    def _dp_steps_each(self) -> bool:
        """Whether ``step()`` may step each bucket's parameters as soon as that bucket is
        averaged, while later buckets are still in flight: only for torch's own
        optimizers whose update of a parameter reads nothing but that parameter's
        gradient, state and group (``_PER_PARAMETER``, the class itself, not a
        subclass), with no step hooks (they would run once per bucket) and no
        ``synchronize`` replaced on the instance (the Horovod adapter's
        ``gradient_predivide_factor``). The result is the same, bit for bit."""
        return (self._dp_worker is not None and type(self).__mro__[1] in _PER_PARAMETER
                and "synchronize" not in self.__dict__
                and not getattr(self, "_optimizer_step_pre_hooks", None)
                and not getattr(self, "_optimizer_step_post_hooks", None)
                and not _optim._global_optimizer_pre_hooks
                and not _optim._global_optimizer_post_hooks)

    def _dp_step_only(self, keep) -> None:
        """The wrapped optimizer's step over the parameters that ``keep(p)`` admits (the
        groups left with none are left out of that step)."""
        groups = self.param_groups
        stash = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if keep(p)]
            self.param_groups = [g for g in groups if g["params"]]
            super(self.__class__, self).step()
        finally:
            self.param_groups = groups
            for g, params in zip(groups, stash):
                g["params"] = params

    def remove_hooks(self) -> None:
        """Detach from the model: later backward passes are not averaged."""
        for h in self._dp_hooks:
            h.remove()
        self._dp_hooks = []


def _drain(waits) -> None:
    """Wait out the buckets still in flight after ``step()`` failed on one of them (their
    results are dropped), so that none lands in a bucket reset for the next step."""
    try:
        for _ in waits:
            pass
    except BaseException:  # noqa: BLE001 - the first error is the one raised
        pass


# torch's optimizers whose update of one parameter reads only that parameter's gradient
# and state and its group's settings: stepping them a bucket at a time is exact.
_PER_PARAMETER = frozenset(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad",
    "Adadelta", "ASGD") if hasattr(torch.optim, n))


class _StepEach:
    """``step()`` a bucket at a time: each bucket's parameters step as soon as it is
    averaged; the parameters in no bucket, and every bucket from the first one with a
    sparse gradient to gather (stepped only after ``gather_sparse``), step at the end."""

    def __init__(self, opt: _DistributedOptimizer) -> None:
        self.opt, self.done = opt, set()
        self.deferred = False

    def bucket(self, b: Bucket) -> None:
        if self.deferred or bool(b.sparse_flags.any()):
            self.deferred = True
            return
        ids = {id(s.param) for s in b.slots}
        self.opt._dp_step_only(lambda p: id(p) in ids)
        self.done.update(ids)

    def rest(self) -> None:
        done = self.done
        if any(id(p) not in done for g in self.opt.param_groups for p in g["params"]):
            self.opt._dp_step_only(lambda p: id(p) not in done)


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
