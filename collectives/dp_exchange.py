"""How ``collectives.dp`` reduces gradient buckets when the job spans hosts.

Within a host the ranks sum a bucket in shared memory (the runtime's allreduce on the
host's communicator); between hosts one rank per host streams it around a TCP ring
(``streamring``); the host's other ranks then get the result by a shared-memory
broadcast. Only one rank per host touches the link, so each host's link carries
2(n-1)/n of a bucket, as a ring over hosts must, and never more.

The host's other ranks wait for the leader's ring on a local socket, in the kernel: a
rank spinning in a shared-memory wait would take the core that the kernel needs to move
the link's packets. That socket's name is random but no secret (other users can list
it): the leader admits only this user's processes (SO_PEERCRED) that send the token it
shared over MPI, and a stranger's connection never takes a rank's place (``_Bell``).

Chosen when the job has more than one host and CPU buckets. ``DTRUN_DP_TRANSPORT=mpi``
keeps every bucket on the runtime's allreduce instead (MPI between hosts);
``DTRUN_DP_RING_PORTS=LOW-HIGH`` says which ports the ring listens on (for a firewall).
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct
import sys
from typing import Any, Callable

import numpy as np

from .handshake import admit, same_user
from .streamring import CONNECT_TIMEOUT_S, RingError, StreamRing

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
    from ._mpi import MPI  # lazy: initialises MPI; dp imports this before init()

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
        from ._mpi import MPI  # lazy: initialises MPI; dp imports this before init()

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
        if self.node is not None:  # collective over the host, whether the ring is up or not
            try:
                self.bell = _Bell(self.node.mpi, comm.rank, up=not problem)
            except _NotOpened:
                pass
            except _NotReached as e:
                problem = str(e)
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
        try:
            return self.ring.submit(flat, finish)
        except RingError as e:  # broken already: the host's others wait for the bell
            if self.bell is not None:
                self.bell.ring(ok=False, why=e.problem)
            raise

    def wait(self, job: Any, flat: np.ndarray) -> None:
        if self.ring is not None:
            try:
                self.ring.wait(job)
            except RingError as e:
                if self.bell is not None:
                    self.bell.ring(ok=False, why=e.problem)
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

    def close(self) -> None:
        """Close the ring and the bell, and free the host's communicator (collective over
        the host)."""
        for part in (self.ring, self.bell):
            if part is not None:
                part.close()
        self.ring = self.bell = None
        if self.node is not None:
            self.node.free()
            self.node = None


def open_exchange(comm: Any, add, scale, copy, what: str = "gradients") -> HostExchange | None:
    """A HostExchange, or None (with one line on rank 0's stderr) if the ring could not
    connect: ``what`` (the buckets, or the runtime's large allreduces) then goes through
    MPI between hosts."""
    try:
        return HostExchange(comm, add, scale, copy)
    except RingError as e:
        if comm.rank == 0:
            who = "dtrun.collectives.dp" if what == "gradients" else "dtrun.collectives"
            print(f"{who}: {e.problem}; {what} go through MPI between hosts instead",
                  file=sys.stderr, flush=True)
        return None


_BELL_HELLO = struct.Struct("<16sI")  # the host's token, the sender's rank within the host


class _Bell:
    """One byte from the host's leader to each of its other ranks when a bucket's ring is
    done (``b"E"`` and the error's text when it failed): they wait in ``recv``, in the
    kernel, not spinning. Collective over ``node`` (the host's ranks; rank 0 is the
    leader), which ``up`` says whether to open (the leader's ring is up).

    The leader listens on an abstract Unix socket. Its name is random and no secret: any
    local user can list it (/proc/net/unix) and connect. A connection is admitted only
    from this user (SO_PEERCRED) with the token the leader sent over MPI and a rank of
    the host not admitted yet; any other is dropped without holding up the real ones."""

    def __init__(self, node: Any, rank: int, up: bool) -> None:
        self.rank = rank
        me, size = node.Get_rank(), node.Get_size()
        self.ranks = node.allgather(rank)  # the host's ranks in the job, for messages
        secret = (f"\0dtrun-dp-{secrets.token_hex(8)}", secrets.token_bytes(16)) \
            if me == 0 and up else None
        secret = node.bcast(secret, root=0)
        if secret is None:  # the leader's ring failed: nothing to open
            raise _NotOpened()
        name, token = secret
        self.peers: list = []
        self.sock = None
        if me == 0:
            try:
                self.peers = self._gather(node, name, token, size)
            except OSError as e:
                raise _NotReached(f"rank {rank}, its host's leader, could not listen for the "
                                  f"host's other ranks: {e.strerror or e}") from None
        else:
            node.Barrier()  # the leader is listening
            try:
                self.sock = _reach(name, token, me)
            except OSError as e:
                raise _NotReached(f"rank {rank} could not reach its host's leader, rank "
                                  f"{self.ranks[0]}: {e.strerror or e}") from None

    def _gather(self, node: Any, name: str, token: bytes, size: int) -> list:
        def judge(s: socket.socket, hello: bytes) -> int | None:
            their_token, who = _BELL_HELLO.unpack(hello)
            return who if same_user(s) and hmac.compare_digest(their_token, token) else None

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                listener.bind(name)
                listener.listen(64)
            finally:
                node.Barrier()  # listening (or not: the others then fail to connect)
            found = admit(listener, _BELL_HELLO.size, judge, set(range(1, size)),
                          CONNECT_TIMEOUT_S)
        finally:
            listener.close()
        missing = [self.ranks[i] for i in range(1, size) if i not in found]
        if missing:
            for s in found.values():
                s.close()
            who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
            raise _NotReached(f"{who} did not connect to {'their' if len(missing) > 1 else 'its'}"
                              f" host's leader, rank {self.rank}, within "
                              f"{CONNECT_TIMEOUT_S:.0f} s")
        return [found[i] for i in range(1, size)]

    def ring(self, ok: bool, why: str = "") -> None:
        note = b"" if ok else why.encode()[:4000]
        for s in self.peers:
            try:
                s.sendall(b"." if ok else b"E" + struct.pack("<I", len(note)) + note)
            except OSError:
                pass  # that rank ended: the others still get their bell

    def listen(self) -> None:
        try:
            got = self.sock.recv(1)
            why = b""
            if got == b"E":
                head = self.sock.recv(4, socket.MSG_WAITALL)
                why = self.sock.recv(struct.unpack("<I", head)[0], socket.MSG_WAITALL) \
                    if len(head) == 4 else b""
        except OSError as e:
            got, why = b"", str(e.strerror or e).encode()
        if got != b".":
            leader = self.ranks[0]
            text = why.decode(errors="replace") or \
                f"its connection to this host's leader, rank {leader}, closed (it ended or failed)"
            raise RingError("allreduce", self.rank, f"the ring between hosts failed on this "
                            f"host's leader, rank {leader}: {text}")

    def close(self) -> None:
        for s in [*self.peers, self.sock]:
            if s is not None:
                s.close()


class _NotOpened(Exception):
    """The leader's ring failed, so the bell was not opened (on every rank of the host)."""


class _NotReached(Exception):
    """A rank of the host could not reach its leader, or the leader missed one."""


def _reach(name: str, token: bytes, me: int):
    """A non-leader's connection to its host's leader (who must be this user too)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(name)
        if not same_user(sock):
            raise _NotReached(f"the socket {name[1:]!r} belongs to another user")
        sock.sendall(_BELL_HELLO.pack(token, me))
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock
