"""``horovod.tensorflow.util`` on dtrun's runtime: the helpers Horovod's TensorFlow module and
tests import (``_executing_eagerly``, ``_make_subgraph``, ``_cache``, ``vars_to_refs``,
``refs_to_vars``), with Horovod's behaviour. Imports TensorFlow, never torch.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from tensorflow.python.eager import context


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs ops eagerly here (False inside ``tf.function`` and in a
    ``tf.compat.v1`` graph)."""
    return context.executing_eagerly()


def _make_subgraph(f: Callable) -> Callable:
    """``f`` as a ``tf.function`` (Horovod runs its eager variable broadcasts this way)."""
    return tf.function(f)


def _cache(f: Callable) -> Callable:
    """``f`` memoised on its (hashable) arguments and on whether TensorFlow runs eagerly."""
    cache: dict = {}

    def wrapper(*args):
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]
    return wrapper


def vars_to_refs(variables: Any) -> Any:
    """Hashable references of a (nested list of) variable(s): tuples of ``var.ref()``."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs: Any) -> Any:
    """The variables behind ``vars_to_refs``' references (tuples become lists)."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
