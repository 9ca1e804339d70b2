"""Picklable Python objects over a ``collectives.Comm``: root's object on every rank, and
every rank's object in rank order. collectives.dp and collectives.horovod both send
objects this way, and neither side may import the other's framework, so this module
uses the standard library and NumPy only.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any

import numpy as np


def broadcast_object(comm: Any, obj: Any, root: int = 0, lock: Any = None) -> Any:
    """Root's ``obj`` on every rank: pickled on root, then two broadcasts (its length, its
    bytes). ``lock``: held around the broadcasts (a communicator shared with a thread)."""
    with lock if lock is not None else contextlib.nullcontext():
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if comm.rank == root else b""
        n = np.array([len(data)], dtype=np.int64)
        comm.broadcast(n, root=root, inplace=True)
        buf = np.frombuffer(bytearray(data), dtype=np.uint8) if comm.rank == root \
            else np.empty(int(n[0]), dtype=np.uint8)
        if buf.size:
            comm.broadcast(buf, root=root, inplace=True)
    return obj if comm.rank == root else pickle.loads(buf.tobytes())


def allgather_objects(comm: Any, obj: Any, lock: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (lengths, then one allgatherv).
    ``lock``: as for ``broadcast_object``."""
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    with lock if lock is not None else contextlib.nullcontext():
        lengths = comm.allgather(np.array([data.size], dtype=np.int64))
        blob = comm.allgatherv(data.copy())
    out, start = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(blob[start:start + n].tobytes()))
        start += n
    return out
