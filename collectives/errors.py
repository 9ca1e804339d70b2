"""Exceptions raised by the collectives runtime.

Every error names the operation, the rank that raised it and the problem, so that
a message from one of many ranks can be read on its own. Standard library only:
the launcher imports this module without touching MPI.
"""

from __future__ import annotations


class CollectiveError(Exception):
    """A collective operation could not run as asked.

    Attributes:
        op: name of the operation, e.g. ``"allreduce"``.
        rank: rank (in the communicator used) that detected the problem, or None.
        problem: what is wrong and, where known, how to fix it.
    """

    def __init__(self, op: str, rank: int | None, problem: str):
        self.op = op
        self.rank = rank
        self.problem = problem
        where = f"rank {rank}" if rank is not None else "rank ?"
        super().__init__(f"{op} on {where}: {problem}")


class UnsupportedDtypeError(CollectiveError, TypeError):
    """The array's dtype has no MPI/NCCL mapping (e.g. complex256, object)."""


class NotContiguousError(CollectiveError, ValueError):
    """The array is a strided view; collectives need one contiguous buffer."""


class ShapeError(CollectiveError, ValueError):
    """Lengths or shapes do not fit the operation (local check)."""


class MismatchError(CollectiveError, ValueError):
    """Ranks called the same collective with different dtypes, lengths, ops or roots."""


class ReadOnlyError(CollectiveError, ValueError):
    """An array the operation writes its result into is read-only (e.g. over ``bytes``)."""


class OverlapError(CollectiveError, ValueError):
    """``out`` shares memory with the input without being the input itself."""


class MPIError(CollectiveError, RuntimeError):
    """MPI itself reported an error (translated from ``mpi4py.MPI.Exception``)."""


class DeviceError(CollectiveError, RuntimeError):
    """A GPU array was given but the GPU support it needs is missing."""
