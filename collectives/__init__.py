"""dtrun's collectives runtime: MPI collectives on NumPy, PyTorch and GPU arrays.

    from dtrun import collectives
    comm = collectives.init()            # = collectives.world()
    y = comm.allreduce(x, op="avg")      # new array
    comm.allreduce(x, inplace=True)      # MPI_IN_PLACE
    h = comm.iallreduce(x); ...; h.wait()
    comm.grouped_allreduce(grads)        # fused, in place

Importing this package neither initialises MPI nor changes ``os.environ``; the first
attribute that needs mpi4py (``Comm``, ``init``, ``world``, ...) initialises MPI.
During that MPI_Init only, ``OMPI_MCA_osc=^ucx`` is set (unless you set
``OMPI_MCA_osc`` yourself), to silence Open MPI 5's "OSC UCX component priority" error
on hosts without UCX; it is removed once MPI is up (see ``collectives._mpi``).
Exceptions are importable without MPI.
"""

from __future__ import annotations

import importlib

from .errors import (CollectiveError, DeviceError, MismatchError, MPIError,
                     NotContiguousError, OverlapError, ReadOnlyError, ShapeError,
                     UnsupportedDtypeError)
from .env import env_local_rank, env_local_size, env_rank, env_size

SUM, PROD, MIN, MAX, AVG = "sum", "prod", "min", "max", "avg"

_LAZY = {
    "Comm": "comm", "init": "comm", "world": "comm", "Handle": "handle",
    "wait_all": "handle", "IN_PLACE": "comm", "ANY_SOURCE": "comm", "ANY_TAG": "comm",
    "BFLOAT16": "dtypes",
}

__all__ = ["Comm", "init", "world", "Handle", "wait_all", "CollectiveError", "DeviceError",
           "MismatchError", "MPIError", "NotContiguousError", "OverlapError", "ReadOnlyError",
           "ShapeError",
           "UnsupportedDtypeError", "SUM", "PROD", "MIN", "MAX", "AVG", "BFLOAT16",
           "env_rank", "env_size", "env_local_rank", "env_local_size"]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
