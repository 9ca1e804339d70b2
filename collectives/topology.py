"""Where a communicator's ranks run: this host's name, its ranks, and the hosts' order.

``discover`` is collective over the communicator (one small allreduce within the host,
one allgather over all ranks). Hosts are numbered by their lowest rank, so every rank
agrees on the numbering without comparing names.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import numpy as np

from ._mpi import MPI


@dataclass(slots=True, frozen=True)
class Topology:
    """The layout ``Comm`` exposes as ``rank``, ``size``, ``host``, ``local_rank``,
    ``local_size``, ``node`` and ``nnodes``.

    ``node_comm`` holds the ranks that share memory with this one; ``uniform`` says
    whether every host runs the same number of ranks (the hierarchical and ring paths
    need it)."""

    rank: int
    size: int
    host: str
    node_comm: MPI.Intracomm
    local_rank: int
    local_size: int
    node: int
    nnodes: int
    uniform: bool


def discover(comm: MPI.Intracomm, node_comm: MPI.Intracomm | None = None) -> Topology:
    """The layout of ``comm`` (collective); ``node_comm`` overrides the grouping into
    hosts (tests emulate several hosts on one machine with it)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if node_comm is None:
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_size = node_comm.Get_size()
    leader = np.array([rank], dtype=np.int64)
    node_comm.Allreduce(MPI.IN_PLACE, leader, op=MPI.MIN)
    table = np.empty((size, 2), dtype=np.int64)
    comm.Allgather(np.array([leader[0], local_size], dtype=np.int64), table)
    leaders = sorted({int(v) for v in table[:, 0]})
    return Topology(rank=rank, size=size, host=MPI.Get_processor_name() or socket.gethostname(),
                    node_comm=node_comm, local_rank=node_comm.Get_rank(), local_size=local_size,
                    node=leaders.index(int(leader[0])), nnodes=len(leaders),
                    uniform=len({int(v) for v in table[:, 1]}) == 1)
