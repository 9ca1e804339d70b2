"""Rank information from the environment, for use before MPI is initialised.

MPI is the source of truth (``Comm.rank``, ``Comm.local_rank``...). These helpers
exist for the one moment it is not available yet: choosing a GPU before CUDA and
MPI start (``device = env_local_rank() % device_count``). They read dtrun's
variables first, then those of the common launchers. Standard library only.
"""

from __future__ import annotations

import os

_RANK = ("DTRUN_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK")
_SIZE = ("DTRUN_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE")
_LOCAL_RANK = ("DTRUN_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
               "SLURM_LOCALID", "LOCAL_RANK")
_LOCAL_SIZE = ("DTRUN_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
               "LOCAL_WORLD_SIZE")


def _first(names: tuple[str, ...], default: int) -> int:
    for name in names:
        raw = os.environ.get(name)
        if raw is not None and raw.strip().isdigit():
            return int(raw)
    return default


def env_rank() -> int:
    return _first(_RANK, 0)


def env_size() -> int:
    return _first(_SIZE, 1)


def env_local_rank() -> int:
    return _first(_LOCAL_RANK, 0)


def env_local_size() -> int:
    return _first(_LOCAL_SIZE, 1)
