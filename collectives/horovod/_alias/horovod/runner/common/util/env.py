"""``horovod.runner.common.util.env`` under ``dtrun --horovod``: ``get_env_rank_and_size``."""

from __future__ import annotations

import os

# Horovod's launchers' names, then Open MPI's and MPICH's, then dtrun's rank wrapper's.
_PAIRS = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
          ("PMI_RANK", "PMI_SIZE"), ("DTRUN_RANK", "DTRUN_SIZE"))


def get_env_rank_and_size() -> tuple[int, int]:
    """(rank, size) of this process from the launcher's environment; (0, 1) outside a job.

    Raises:
        RuntimeError: only one of a pair is set.
    """
    for rank_var, size_var in _PAIRS:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"cannot tell this process's rank and size: {rank_var if rank is not None else size_var} "
                               f"is set but not {size_var if rank is not None else rank_var}")
    return 0, 1
