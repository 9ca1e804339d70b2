"""How a Horovod collective runs as a TensorFlow op: NumPy arrays through the engine of its
process set (``collectives/horovod/_engine.py``), matched across ranks by name.

Eager, the collective runs at once under its name (unnamed: ``<kind>.noname.<n>``, counted
in call order, the same on every rank). In a graph (``tf.function``, ``tf.compat.v1``) it
runs inside ``tf.py_function`` when the graph runs, and TensorFlow runs a graph's
independent ops on several threads in no fixed order: the name is therefore fixed when the
op is BUILT, as Horovod names its ops, after the op (``HorovodAllreduce_<tensor name>``, made
unique in its graph by TensorFlow) plus the number of times this rank has run that op
(``.0``, ``.1``, ...), so every rank submits the same name for the same op and run, whatever
order its threads take.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from .. import _core
from . import _errors

# A collective's kernel holds a thread of TensorFlow's inter-op pool until every rank has
# submitted it. With as few threads as cores, ranks whose threads happen to start
# different independent collectives first fill their pools with ones the other ranks have
# not reached, and none can run (the engine reports a deadlock after
# DTRUN_HVD_DEADLOCK_S). A larger pool lets every independent collective of a graph step
# be submitted; a step with more of them than threads needs them grouped
# (grouped_allreduce) or ordered by control dependencies. Only where the user set no
# size; TensorFlow reads it when it creates the pool (the first session).
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "64")
_errors.install()

_RUNS: dict[str, int] = {}  # a graph op's collective name -> runs of it on this rank
_RUNS_LOCK = threading.Lock()


def normalize(name: str) -> str:
    """``name`` with what TensorFlow's op names do not take replaced by ``_`` (Horovod's)."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def graph_name(prefix: str, tensors: list, name: str | None) -> str | None:
    """The op name of a collective: ``name`` when given; unnamed and in a graph, Horovod's
    ``<prefix>_<tensor name>`` (grouped: the first and last tensors' names)."""
    if name is not None or tf.executing_eagerly():
        return name
    names = [tensors[0].name] if len(tensors) == 1 else [tensors[0].name, tensors[-1].name]
    return normalize("_".join([prefix] + names))


def _next_run(base: str) -> str:
    with _RUNS_LOCK:
        n = _RUNS.get(base, 0)
        _RUNS[base] = n + 1
    return f"{base}.{n}"


def _np(t) -> np.ndarray:
    a = t.numpy()
    return np.ascontiguousarray(a) if isinstance(a, np.ndarray) else np.asarray(a)


def scope(process_set: Any, kind: str):
    """The scope of ``process_set`` for ``kind``; a set that is unknown, removed or
    without this rank is Horovod's InvalidArgumentError (a ValueError too)."""
    try:
        return _core.scope(process_set, kind)
    except ValueError as e:
        raise _errors.HorovodInvalidArgumentError(None, None, str(e)) from None


Fn = Callable[..., list]  # (scope, *arrays) -> list of arrays, run on the engine's thread


def execute(kind: str, fn: Fn, arrays: list[np.ndarray], name: str | None, process_set: Any,
            op: str = "", root: int = -1, check: Fn | None = None) -> list[np.ndarray]:
    """Run ``fn`` as the collective ``kind`` named ``name`` (None: the next unnamed name)
    on every rank of ``process_set``; ``check(scope, *arrays)`` first (local errors)."""
    from ...dtypes import dtype_name  # lazy: initialises MPI; hvd.init() does, not the import
    sc = scope(process_set, kind)
    if check is not None:
        check(sc, *arrays)
    req = _core.Request(kind, sc.engine.name(kind, name), tuple(a.shape for a in arrays),
                        tuple(dtype_name(a.dtype) for a in arrays), op, root,
                        lambda: fn(sc, *arrays))
    return sc.engine.synchronize(sc.engine.submit(req))


def run(kind: str, fn: Fn, inputs: list, out_dtypes: list, out_shapes: list | None = None, *,
        name: str | None = None, process_set: Any = None, op: str = "", root: int = -1,
        check: Fn | None = None, ignore_name_scope: bool = False) -> list[tf.Tensor]:
    """The collective ``kind`` on ``inputs`` (tensors), as tensors of ``out_dtypes``:
    run now when eager, else as an op of the graph being built (see the module
    docstring; ``name``: the op's name, ``graph_name``'s)."""
    scope(process_set, kind)  # an unknown or foreign set fails where the op is built
    if tf.executing_eagerly():
        try:
            outs = execute(kind, fn, [_np(t) for t in inputs], name, process_set, op, root, check)
        except Exception as e:
            raise _errors.translate(e, in_graph=False) from None
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, out_dtypes)]
    built: list[str] = []

    def body(*tensors):
        try:
            outs = execute(kind, fn, [_np(t) for t in tensors], _next_run(built[0]),
                           process_set, op, root, check)
        except Exception as e:
            raise _errors.translate(e, in_graph=True) from None
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, out_dtypes)]
    outs = tf.py_function(body, list(inputs), list(out_dtypes), name=name)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    op_name = outs[0].op.name
    built.append(op_name.rsplit("/", 1)[-1] if ignore_name_scope else op_name)
    for o, s in zip(outs, out_shapes or []):
        if s is not None:
            o.set_shape(s)
    return outs


def local(kind: str, fn: Callable[[], Any], out_dtype, name: str) -> tf.Tensor:
    """``fn()`` (no tensor in; an engine call such as join) as a tensor: now when eager,
    else when the graph runs."""
    if tf.executing_eagerly():
        return tf.convert_to_tensor(fn(), dtype=out_dtype)
    return tf.py_function(lambda: tf.convert_to_tensor(fn(), dtype=out_dtype), [], out_dtype,
                          name=name)
