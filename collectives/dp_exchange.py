"""How ``collectives.dp`` reduces gradient buckets when the job spans hosts.

Within a host the ranks sum a bucket in shared memory (the runtime's allreduce on the
host's communicator); between hosts one rank per host streams it around a TCP ring
(``streamring``); the host's other ranks then get the result by a shared-memory
broadcast. Only one rank per host touches the link, so each host's link carries
2(n-1)/n of a bucket, as a ring over hosts must, and never more.

The host's other ranks wait for the leader's ring on a local socket, in the kernel: a
rank spinning in a shared-memory wait would take the core that the kernel needs to move
the link's packets.

Chosen when the job has more than one host and CPU buckets. ``DTRUN_DP_TRANSPORT=mpi``
keeps every bucket on the runtime's allreduce instead (MPI between hosts);
``DTRUN_DP_RING_PORTS=LOW-HIGH`` says which ports the ring listens on (for a firewall).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import numpy as np

from .streamring import RingError, StreamRing

TRANSPORTS = ("auto", "ring", "mpi")


def ring_ports(value: str | None) -> tuple[int, int] | None:
    """``DTRUN_DP_RING_PORTS`` (``LOW-HIGH``: the ports the ring may listen on, for a
    firewall) as a pair, or None (any free port). ValueError when malformed."""
    if value is None or not value.strip():
        return None
    low, sep, high = value.strip().partition("-")
    if not (sep and low.isdigit() and high.isdigit() and 1024 <= int(low) <= int(high) <= 65535):
        raise ValueError(f"DTRUN_DP_RING_PORTS={value!r}: expected LOW-HIGH, ports from 1024 "
                         "to 65535, e.g. 47000-47100")
    return int(low), int(high)


def _setting_problem() -> str:
    choice = os.environ.get("DTRUN_DP_TRANSPORT", "auto").strip().lower() or "auto"
    if choice not in TRANSPORTS:
        return f"DTRUN_DP_TRANSPORT is {choice!r}; use one of {', '.join(TRANSPORTS)}"
    try:
        ring_ports(os.environ.get("DTRUN_DP_RING_PORTS"))
    except ValueError as e:
        return str(e)
    return ""


def wanted(comm: Any, cpu: bool) -> bool:
    """Whether buckets should go through the ring (the same answer on every rank:
    collective over ``comm``). Raises ValueError on every rank when DTRUN_DP_TRANSPORT or
    DTRUN_DP_RING_PORTS is malformed on some rank."""
    from ._mpi import MPI

    problem = _setting_problem()
    choice = os.environ.get("DTRUN_DP_TRANSPORT", "auto").strip().lower() or "auto"
    mine = -1 if problem else int(choice != "mpi" and cpu and comm.nnodes > 1)
    agreed = comm.mpi.allreduce(mine, op=MPI.MIN)
    if agreed < 0:
        raise ValueError(problem or "DTRUN_DP_TRANSPORT or DTRUN_DP_RING_PORTS is malformed on "
                         "another rank; set them alike on every rank")
    return bool(agreed)


class HostExchange:
    """Collective to create over the job's ``comm`` (a collectives Comm). ``start`` sums a
    bucket within the host and hands it to the ring; ``wait`` finishes it (every rank
    then holds the sum over all ranks, scaled by ``scale``)."""

    def __init__(self, comm: Any, add: Callable[[np.ndarray, np.ndarray], None],
                 scale: Callable[[np.ndarray, float], None],
                 copy: Callable[[np.ndarray, np.ndarray], None]) -> None:
        from ._mpi import MPI

        self._scale, self._copy = scale, copy
        self._wide = np.empty(0, np.float32)
        self.node = comm.split_by_node() if comm.local_size > 1 else None
        leader = comm.local_rank == 0
        sub = comm.mpi.Split(0 if leader else MPI.UNDEFINED, comm.rank)
        self.ring: StreamRing | None = None
        problem = ""
        if leader:
            try:
                self.ring = StreamRing(sub, add,
                                       ports=ring_ports(os.environ.get("DTRUN_DP_RING_PORTS")),
                                       ranks=sub.allgather(comm.rank))
            except RingError as e:
                problem = e.problem
            finally:
                sub.Free()
        self.bell: _Bell | None = None
        if self.node is not None and not problem:
            try:
                self.bell = _Bell(self.node.mpi, comm.rank)
            except OSError as e:
                problem = f"rank {comm.rank} could not reach its host's leader: {e}"
        problems = [p for p in comm.mpi.allgather(problem) if p]
        if problems:
            for part in (self.ring, self.bell):
                if part is not None:
                    part.close()
            if self.node is not None:
                self.node.free()
            raise RingError("DistributedOptimizer", comm.rank, problems[0])

    def start(self, flat: np.ndarray, scale: float | None) -> Any:
        if self.node is not None and flat.dtype == np.float16:
            # The runtime's shared memory has no float16 kernel (its fallback is ~15x slower
            # than float32's): sum within the host in float32, which is also more exact.
            if self._wide.size < flat.size:
                self._wide = np.empty(flat.size, np.float32)
            wide = self._wide[:flat.size]
            self._copy(wide, flat)
            self.node.allreduce(wide, inplace=True)
            self._copy(flat, wide)
        elif self.node is not None:
            self.node.allreduce(flat, inplace=True)
        if self.ring is None:
            return None
        finish = None if scale is None else (lambda x: self._scale(x, scale))
        return self.ring.submit(flat, finish)

    def wait(self, job: Any, flat: np.ndarray) -> None:
        if self.ring is not None:
            try:
                self.ring.wait(job)
            except RingError:
                if self.bell is not None:
                    self.bell.ring(ok=False)
                raise
        if self.bell is not None and self.ring is not None:
            self.bell.ring(ok=True)
        elif self.bell is not None:
            self.bell.listen()
        if self.node is not None:
            self.node.broadcast(flat, root=0, inplace=True)

    @property
    def local(self) -> bool:
        return self.node is not None


def open_exchange(comm: Any, add, scale, copy) -> HostExchange | None:
    """A HostExchange, or None (with one line on rank 0's stderr) if the ring could not
    connect: the buckets then go through the runtime's allreduce."""
    try:
        return HostExchange(comm, add, scale, copy)
    except RingError as e:
        if comm.rank == 0:
            print(f"collectives.dp: {e.problem}; gradients go through MPI between hosts instead",
                  file=sys.stderr, flush=True)
        return None


class _Bell:
    """One byte from the host's leader to each of its other ranks when a bucket's ring is
    done (``b"E"`` when it failed): they wait in ``recv``, in the kernel, not spinning.
    Collective over ``node`` (the host's ranks; rank 0 is the leader). An abstract Unix
    socket named by a random token; a connection must present the token."""

    def __init__(self, node: Any, rank: int) -> None:
        import secrets
        import socket

        self.rank = rank
        token = node.bcast(secrets.token_hex(16) if node.Get_rank() == 0 else None, root=0)
        name = f"\0dtrun-dp-{token}"
        self.peers: list = []
        self.sock = None
        if node.Get_rank() == 0:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(name)
            listener.listen(node.Get_size())
            node.Barrier()  # listening: the others may connect
            listener.settimeout(10)
            try:
                while len(self.peers) < node.Get_size() - 1:
                    s, _ = listener.accept()
                    s.settimeout(10)
                    got = s.recv(32, socket.MSG_WAITALL)
                    s.settimeout(None)
                    if got == token.encode():
                        self.peers.append(s)
                    else:
                        s.close()
            finally:
                listener.close()
        else:
            node.Barrier()
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10)
            self.sock.connect(name)
            self.sock.sendall(token.encode())
            self.sock.settimeout(None)

    def ring(self, ok: bool) -> None:
        for s in self.peers:
            s.sendall(b"." if ok else b"E")

    def listen(self) -> None:
        got = self.sock.recv(1)
        if got != b".":
            why = "failed" if got == b"E" else "ended"
            raise RingError("allreduce", self.rank, f"the ring between hosts {why} on this "
                            "host's leader (its local rank 0)")

    def close(self) -> None:
        for s in [*self.peers, self.sock]:
            if s is not None:
                s.close()
