"""``horovod.torch.elastic`` on dtrun's restarts: ``run``, ``TorchState``, ``ElasticSampler``.

``state.commit()`` keeps the model's, the optimizers' and the samplers' state dicts and the
other attributes in memory and, when dtrun restarts the run, on each host's disk; after a
lost host or a change of hosts the next attempt resumes from the newest commit
(collectives/horovod/_elastic.py says how).
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import torch
import torch.utils.data

from .. import _core
from .._elastic import ObjectState, run_fn
from . import init, shutdown
from .functions import broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState", "ElasticSampler", "run", "ObjectState"]


def run(func):
    """Decorator for the elastic training function ``func(state, ...)``: it starts from the
    newest commit of the run (on any host), synchronised from rank 0, and again after each
    reset. Collectives must not run outside it once the job may change."""
    return run_fn(func, _reset)


def _reset() -> None:
    shutdown()
    init()


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset across the ranks and, after a reset, spreads the samples not yet
    processed this epoch over the new ranks (Horovod's ``ElasticSampler``).

    Call ``record_batch`` after each batch and ``set_epoch`` at the end of each epoch, and
    keep the sampler in the ``TorchState``.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = self.rank = self.num_samples = self.total_size = 0
        self.remaining_indices: list = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def reset(self) -> None:
        self.num_replicas = _core.job("ElasticSampler").size
        self.rank = _core.job("ElasticSampler").rank
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """Keeps one stateful object's committed state dict."""

    def __init__(self, value: Any):
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _Model(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _Optimizer(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _Sampler(_Handler):
    def sync(self) -> None:
        self.value.load_state_dict(_core.broadcast_object(self.value.state_dict(), name="dtrun.elastic.sampler"))


_HANDLERS = [(torch.nn.Module, _Model), (torch.optim.Optimizer, _Optimizer), (ElasticSampler, _Sampler)]


class TorchState(ObjectState):
    """The state of a PyTorch training: ``model``, ``optimizer`` and any other keyword
    arguments (more models, optimizers and ElasticSamplers are handled by their state dicts;
    everything else as plain objects), each an attribute."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for k, v in kwargs.items():
            cls = next((h for t, h in _HANDLERS if isinstance(v, t)), None)
            if cls is not None:
                handlers[k] = cls(v)
            else:
                plain[k] = v
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=_core.broadcast_object, get_rank=lambda: _core.job("TorchState").rank,
                         **plain)

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def _snapshot(self) -> Any:
        return {"objects": self._saved_state, "handlers": {k: h.saved for k, h in self._handlers.items()}}

    def _load_snapshot(self, snap: Any) -> None:
        super()._load_snapshot(snap)
        for k, saved in snap.get("handlers", {}).items():
            if k in self._handlers:
                self._handlers[k].saved = saved
