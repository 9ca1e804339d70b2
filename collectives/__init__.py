"""dtrun's collectives runtime: MPI collectives on NumPy, PyTorch and GPU arrays.

    import collectives
    comm = collectives.init()            # = collectives.world()
    y = comm.allreduce(x, op="avg")      # new array
    comm.allreduce(x, inplace=True)      # MPI_IN_PLACE
    h = comm.iallreduce(x); ...; h.wait()
    comm.grouped_allreduce(grads)        # fused, in place

Importing this package does not initialise MPI; the first attribute that needs
mpi4py (``Comm``, ``init``, ``world``, ...) does. Exceptions are importable without MPI.
"""

from __future__ import annotations

import os as _os
import sys as _sys

_OSC_SET = False
if "mpi4py.MPI" not in _sys.modules and "OMPI_MCA_osc" not in _os.environ:
    # Open MPI 5 prints "OSC UCX component priority set inside component query failed"
    # on hosts without UCX devices when the first window (our shared-memory one) is
    # created. Shared-memory windows are served by osc/sm anyway. It must be set before
    # MPI_Init (mpi4py's import), which is why it is here; a user's setting wins.
    # collectives.comm removes it again once MPI is up, so child processes (another
    # mpirun started by this program) do not inherit it.
    _os.environ["OMPI_MCA_osc"] = "^ucx"
    _OSC_SET = True

from .errors import (CollectiveError, DeviceError, MismatchError, MPIError,
                     NotContiguousError, ShapeError, UnsupportedDtypeError)
from .env import env_local_rank, env_local_size, env_rank, env_size

SUM, PROD, MIN, MAX, AVG = "sum", "prod", "min", "max", "avg"

_LAZY = {
    "Comm": "comm", "init": "comm", "world": "comm", "Handle": "handle",
    "wait_all": "handle", "IN_PLACE": "comm", "ANY_SOURCE": "comm", "ANY_TAG": "comm",
    "BFLOAT16": "dtypes",
}

__all__ = ["Comm", "init", "world", "Handle", "wait_all", "CollectiveError", "DeviceError",
           "MismatchError", "MPIError", "NotContiguousError", "ShapeError",
           "UnsupportedDtypeError", "SUM", "PROD", "MIN", "MAX", "AVG", "BFLOAT16",
           "env_rank", "env_size", "env_local_rank", "env_local_size"]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
