"""Horovod's ``DistributedOptimizer`` for PyTorch.

Over every rank (the default process set) it is ``collectives.dp``'s optimizer: gradients
averaged in buckets overlapped with the backward pass. Over a process set it works as
Horovod's does: each parameter's gradient is allreduced on the set by name as soon as it
is accumulated, and ``synchronize()`` waits for them; a rank outside the set steps alone.
With ``op=hvd.Adasum`` it is Horovod's Adasum optimizer: each rank steps on its own
gradients, and the parameters' changes are combined with Adasum.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

from ... import dp
from .. import _core
from .._core import Adasum, Average, Sum, global_process_set
from . import _base, ops
from .compression import Compression

_STEP_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                 "optimizer.synchronize(). This can cause training slowdown. You may want to "
                 "consider using optimizer.skip_synchronize() context if you use "
                 "optimizer.synchronize() in your code.")
_TOO_MANY = ("Gradients were computed more than backward_passes_per_step times before call "
             "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
_ZERO_GRAD = ("optimizer.zero_grad() was called after loss.backward() but before "
              "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
              "a race condition.")


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 (Horovod's name)
                         named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups=None, sparse_as_dense: bool = False,
                         process_set=global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients reduced over the process set.

    ``op``: Average (default), Sum or Adasum. ``gradient_predivide_factor`` f divides
    each gradient by f before the sum and multiplies the average by f after (op=Average
    only, as Horovod). ``groups``/``num_groups`` only regroup Horovod's fusion: the result
    is the same. Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as Horovod
    does: gathered as indices and values (``sparse_as_dense=False``, the default), or as
    dense tensors (``sparse_as_dense=True``); ``.grad`` stays sparse either way.
    ``HOROVOD_FUSION_THRESHOLD`` (bytes) sets the bucket size over every rank.
    """
    op = _core.check_op(op, "DistributedOptimizer", (Average, Sum, Adasum))
    f = float(gradient_predivide_factor)
    if f != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if f <= 0:
        raise ValueError("gradient_predivide_factor must be > 0")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning, stacklevel=2)
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    j = _core.job("DistributedOptimizer")
    if op == Adasum and j.size > 1:
        if process_set not in (None, global_process_set):
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        _base.check_adasum(_base.scope(None, "DistributedOptimizer"), "DistributedOptimizer")
        return _wrap(optimizer, _AdasumOptimizer, named_parameters, compression,
                     backward_passes_per_step)
    if process_set in (None, global_process_set):
        named = _named(optimizer, named_parameters)
        dist = _over_every_rank(optimizer, named, compression, backward_passes_per_step,
                                Sum if op == Sum else Average, f, sparse_as_dense)
        dist._parameter_names = {v: k for k, v in sorted(named, key=lambda kv: kv[0])}
        return dist
    if not isinstance(process_set, _core.ProcessSet) or process_set.included() is None:
        raise ValueError(f"DistributedOptimizer: process_set={process_set!r} is not registered "
                         "(hvd.add_process_set), or was removed")
    return _wrap(optimizer, _SetOptimizer, named_parameters, compression,
                 backward_passes_per_step, op, f, sparse_as_dense, process_set)


def _over_every_rank(optimizer, named_parameters, compression, k, op, f, sparse_as_dense):
    """``collectives.dp``'s optimizer with Horovod's arguments."""
    extra = {}
    fusion = os.environ.get("HOROVOD_FUSION_THRESHOLD", "").strip()
    if fusion:  # Horovod's fusion buffer size: here, the bytes per gradient bucket
        if not fusion.isdigit() or int(fusion) < 1:
            raise ValueError(f"HOROVOD_FUSION_THRESHOLD={fusion!r}: expected a number of bytes")
        extra["bucket_bytes"] = int(fusion)
    dist = dp.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                   op=dp.AVG if op == Average else dp.SUM,
                                   backward_passes_per_step=k,
                                   compression=Compression.to_dp(compression),
                                   sparse_as_dense=sparse_as_dense, **extra)
    if f != 1.0 and _core.size() > 1:
        _predivide(dist, f)
    return dist


def _predivide(dist: Any, f: float) -> None:
    """Horovod's gradient_predivide_factor on collectives.dp's optimizer: each gradient is
    divided by f as it enters its bucket, and the averaged result multiplied by f.
    Gathered sparse gradients are averaged as they are (Horovod's sparse path)."""
    fill, sync = dist._dp_fill, dist.synchronize

    def prescaled_fill(slot):
        fill(slot)
        b = slot.bucket
        b.flat[slot.offset:slot.offset + slot.numel].mul_(1.0 / f)

    def postscaled_synchronize():
        sync()
        with torch.no_grad():
            for s in dist._dp_slots:
                if s.param.grad is not None and not s.gathered:
                    s.param.grad.mul_(f)

    dist._dp_fill = prescaled_fill
    dist.synchronize = postscaled_synchronize


def _wrap(optimizer, mixin, *args) -> torch.optim.Optimizer:
    """An instance of the optimizer's own class with ``mixin``'s methods, sharing its
    parameter groups and state (as collectives.dp's optimizer does)."""
    methods = {}
    for base in reversed(mixin.__mro__[:-1]):  # _Hooks, then the mixin itself
        methods.update({k: v for k, v in base.__dict__.items()
                        if k not in ("__dict__", "__weakref__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    dist = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)
    dist._hvd_setup(*args)
    return dist


def _named(opt: torch.optim.Optimizer, named_parameters: Any) -> list:
    """Horovod's checks of ``named_parameters`` (ValueError), or its default names."""
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", v) for i, g in enumerate(opt.param_groups)
                for j, v in enumerate(g["params"])]
    named = list(named_parameters)
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [k for k, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found "
                         f"duplicates: {', '.join(dups)}")
    known = {id(v) for _, v in named}
    unnamed = [id(v) for g in opt.param_groups for v in g["params"] if id(v) not in known]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named. Python object ids: {', '.join(map(str, unnamed))}")
    return named


class _Hooks:
    """What Horovod's two optimizers share: names, the per-parameter countdown of
    backward passes, hooks on gradient accumulation, and ``zero_grad``'s check."""

    def _hvd_common(self, named_parameters, compression, k) -> None:
        named = _named(self, named_parameters)
        self._parameter_names = {v: k for k, v in sorted(named, key=lambda kv: kv[0])}
        self._hvd_compression, self._hvd_k = compression, int(k)
        self._hvd_delay = {id(v): self._hvd_k for _, v in named}
        self._hvd_handles: dict = {}  # param -> (handle, ctx)
        self._hvd_requires: list = []
        self._hvd_hooks: list = []

    def _hvd_register(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._hvd_requires.append(p)
                    self._hvd_hooks.append(p.register_post_accumulate_grad_hook(
                        self._hvd_make_hook(p)))

    def _hvd_make_hook(self, p):
        def hook(*_):
            pending = self._hvd_handles.get(p)
            if pending is not None and pending[0] is not None \
                    and self._hvd_delay[id(p)] <= 0:
                raise AssertionError(_TOO_MANY)
            self._hvd_delay[id(p)] -= 1
            handle, ctx = None, None
            if self._hvd_delay[id(p)] == 0:
                handle, ctx = self._hvd_allreduce(p)
            self._hvd_handles[p] = (handle, ctx)
        return hook

    def _hvd_missing(self) -> None:
        """Start the reduction of every parameter whose hook did not (no gradient on this
        rank, or fewer backward passes than backward_passes_per_step)."""
        for p in self._hvd_requires:
            if p not in self._hvd_handles or self._hvd_handles[p][0] is None:
                self._hvd_handles[p] = self._hvd_allreduce(p)

    def zero_grad(self, set_to_none: bool = True):
        if self._hvd_handles:
            raise AssertionError(_ZERO_GRAD)
        return super(self.__class__, self).zero_grad(set_to_none)

    def remove_hooks(self) -> None:
        """Detach from the model: later backward passes are not reduced."""
        for h in self._hvd_hooks:
            h.remove()
        self._hvd_hooks = []


class _SetOptimizer(_Hooks):
    """Horovod's DistributedOptimizer over a process set (see the module docstring)."""

    def _hvd_setup(self, named_parameters, compression, k, op, f, sparse_as_dense,
                   process_set) -> None:
        self._hvd_common(named_parameters, compression, k)
        self._hvd_op, self._hvd_f, self._hvd_sparse_as_dense = op, f, sparse_as_dense
        self._hvd_set = process_set
        self._hvd_synchronized, self._hvd_should_sync = False, True
        if process_set.included() and _core.size() > 1:
            self._hvd_register()

    def _hvd_allreduce(self, p):
        if p.grad is None:
            p.grad = torch.zeros_like(p.data)
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self._hvd_sparse_as_dense:
                return ops.sparse_allreduce_async(tensor, name, self._hvd_op,
                                                  self._hvd_set), None
            tensor = tensor.to_dense()
        compressed, ctx = self._hvd_compression.compress(tensor)
        pre, post = (1.0 / self._hvd_f, self._hvd_f) if self._hvd_op == Average else (1.0, 1.0)
        return ops.allreduce_async_(compressed, name=name, op=self._hvd_op,
                                    prescale_factor=pre, postscale_factor=post,
                                    process_set=self._hvd_set), ctx

    def synchronize(self) -> None:
        """Finish reducing the gradients now (e.g. before clipping them)."""
        if not self._hvd_set.included():
            self._hvd_synchronized = True
            return
        self._hvd_missing()
        for p, (handle, ctx) in self._hvd_handles.items():
            output = _base.synchronize(handle)
            self._hvd_delay[id(p)] = self._hvd_k
            out = self._hvd_compression.decompress(output, ctx)
            if p.grad.is_sparse:
                p.grad = out if out.is_sparse else out.to_sparse(p.grad.sparse_dim())
            else:
                p.grad.set_(out)
        self._hvd_handles.clear()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize again: for gradient
        clipping after an explicit ``synchronize()``."""
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def step(self, closure=None):
        if self._hvd_should_sync:
            if self._hvd_synchronized:
                warnings.warn(_STEP_WARNING, stacklevel=2)
            self.synchronize()
        self._hvd_synchronized = False
        return super(self.__class__, self).step(closure)


class _AdasumOptimizer(_Hooks):
    """Horovod's Adasum optimizer: each parameter steps on this rank's gradient as soon
    as it is accumulated; its change is combined over ranks with Adasum in ``step()``,
    starting from where every rank started."""

    def _hvd_setup(self, named_parameters, compression, k) -> None:
        self._hvd_common(named_parameters, compression, k)
        self._hvd_start = {id(p): torch.zeros_like(p, requires_grad=False)
                           for g in self.param_groups for p in g["params"]}
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p.data)
        self._hvd_register()

    def _hvd_allreduce(self, p):
        name = self._parameter_names.get(p)
        start = self._hvd_start[id(p)]
        stashed = [g["params"] for g in self.param_groups]
        for g in self.param_groups:  # step this parameter alone
            g["params"] = [p] if any(p is v for v in g["params"]) else []
        try:
            start.data.copy_(p)
            super(self.__class__, self).step()
            p.data.sub_(start)
        finally:
            for g, params in zip(self.param_groups, stashed):
                g["params"] = params
        compressed, ctx = self._hvd_compression.compress(p)
        return ops.allreduce_async_(compressed.data, name=name, op=Adasum), ctx

    def synchronize(self) -> None:
        pass

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")
        yield  # pragma: no cover

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._hvd_missing()
        for p, (handle, ctx) in self._hvd_handles.items():
            delta = self._hvd_compression.decompress(_base.synchronize(handle), ctx)
            start = self._hvd_start[id(p)]
            start.data.add_(delta.data)
            p.data.copy_(start)
            self._hvd_delay[id(p)] = self._hvd_k
        self._hvd_handles.clear()
        return loss


__all__ = ["DistributedOptimizer"]
