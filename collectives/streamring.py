"""A streaming ring allreduce over TCP between hosts, for data-parallel gradient buckets.

Why not MPI here: across hosts MPI's TCP transport makes progress only while a thread
polls inside an MPI call. When that thread competes for a core with backward's compute
(and with the other ranks on the host), the socket buffers drain and the link idles;
each bucket is also one whole collective, so the link drains again between buckets.
This ring keeps the link busy instead:

* one TCP connection to the next rank and one from the previous rank, with blocking
  sockets: a waiting thread costs no CPU, and the kernel keeps sending from the socket
  buffer while the threads sleep;
* every bucket is cut into chunks, and a chunk moves on as soon as it is reduced, so a
  bucket's reduce-scatter and allgather and the next bucket's start all share the link;
* chunks carry a header (bucket number, step, chunk, size, a signature of the bucket),
  so each rank can be at a different point of the stream, and a bucket that differs
  between ranks is an error that names both sides, never a wrong sum.

Exactness: part k of a bucket is reduced along one chain of ranks and then copied to
everyone, so every rank ends with the same bits.

Connections are made once, to the peer address that shares a subnet with this host (or
the interface named in ``btl_tcp_if_include``). The listener is open to anyone who can
reach the port: a connection is admitted only with the random token that rank 0 sent
over MPI (compared in constant time) and the expected rank; anything else, garbage or a
silent connection included, is dropped without holding up the real peer
(``handshake.admit``).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import queue
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

from .errors import CollectiveError, MismatchError
from .handshake import admit

CHUNK_BYTES = 512 * 1024
CONNECT_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 10.0  # for the ring's threads to end on close()
_HDR = struct.Struct("<IIIIQ")  # bucket number, step, chunk, bytes, bucket signature
_HELLO = struct.Struct("<16sI")  # token, sender's ring rank


class RingError(CollectiveError):
    """The ring's connection failed, or a peer sent what this rank did not expect."""


class _PeerClosed(RingError):
    """The previous rank closed its connection between chunks (never seen by callers:
    the receiver turns it into a RingError, or into the neighbour's end)."""


class RingMismatchError(RingError, MismatchError):
    """Ranks submitted different buckets (size or dtype) at the same place in the order."""


def _signature(flat: np.ndarray) -> int:
    return (flat.size << 8) | ord(flat.dtype.char)


def _describe(sig: int) -> str:
    try:
        name = np.dtype(chr(sig & 0xFF)).name
    except TypeError:
        name = f"dtype code {sig & 0xFF}"
    return f"{sig >> 8} {name} elements"


def _local_networks(include: str | None) -> list[ipaddress.IPv4Interface]:
    """This host's IPv4 interfaces other than loopback (only those ``include`` names,
    as Open MPI's ``btl_tcp_if_include``: interface names or CIDR blocks)."""
    import psutil

    stats = psutil.net_if_stats()
    wanted = [w.strip() for w in include.split(",") if w.strip()] if include else []
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        if name == "lo" or (name in stats and not stats[name].isup):
            continue
        for a in addrs:
            if a.family != socket.AF_INET or not a.netmask:
                continue
            iface = ipaddress.IPv4Interface(f"{a.address}/{a.netmask}")
            if iface.ip.is_loopback:
                continue
            if wanted and not any(_matches(w, name, iface) for w in wanted):
                continue
            out.append(iface)
    return out


def _matches(wanted: str, name: str, iface: ipaddress.IPv4Interface) -> bool:
    if "/" in wanted:
        try:
            return iface.ip in ipaddress.IPv4Network(wanted, strict=False)
        except ValueError:
            return False
    return wanted == name


def _order_for(peer: list[str], mine: list[ipaddress.IPv4Interface]) -> list[str]:
    """The peer's addresses, those on one of this host's subnets first."""
    nets = [m.network for m in mine]
    near = [a for a in peer if any(ipaddress.IPv4Address(a) in n for n in nets)]
    return near + [a for a in peer if a not in near]


class _Job:
    __slots__ = ("seq", "flat", "sig", "bounds", "chunk", "left", "unsent", "done", "error",
                 "finish")

    def __init__(self, seq: int, flat: np.ndarray, sig: int, p: int, chunk: int, finish):
        self.seq, self.flat, self.sig, self.finish = seq, flat, sig, finish
        self.bounds = [flat.size * k // p for k in range(p + 1)]
        self.chunk = chunk
        self.left = 0  # chunks still to receive
        self.unsent = 0  # chunks queued but not yet written to the socket
        self.done = threading.Event()
        self.error: BaseException | None = None

    def chunks(self, part: int) -> list[tuple[int, int]]:
        lo, hi = self.bounds[part], self.bounds[part + 1]
        return [(i, min(i + self.chunk, hi)) for i in range(lo, hi, self.chunk)]


class StreamRing:
    """Ring allreduce of 1-D NumPy buckets, streamed. Collective to create over ``comm``
    (an MPI communicator with one rank per host): every rank then calls ``submit`` with
    buckets of the same size and dtype, in the same order; ``wait`` returns when this
    rank's bucket holds the result. ``add(dst, src)`` computes ``dst += src`` in place
    (NumPy's, or faster kernels such as torch's for float16)."""

    def __init__(self, comm: Any, add: Callable[[np.ndarray, np.ndarray], None] | None = None,
                 chunk_bytes: int = CHUNK_BYTES, ports: tuple[int, int] | None = None,
                 ranks: list[int] | None = None) -> None:
        self.p, self.r = comm.Get_size(), comm.Get_rank()
        # how messages name the ring's members (e.g. their ranks in the job), and this one
        self.ranks = list(ranks) if ranks is not None else list(range(self.p))
        self.me = self.ranks[self.r]
        self._add = add or (lambda dst, src: np.add(dst, src, out=dst))
        self._chunk_bytes = int(chunk_bytes)
        self._jobs: dict[int, _Job] = {}
        self._cv = threading.Condition()
        self._seq = 0
        self._broken: BaseException | None = None
        self._left_gone: RingError | None = None  # the previous rank closed after its last bucket
        self._sendq: queue.Queue = queue.Queue()
        self._scratch = np.empty(self._chunk_bytes + 64, np.uint8)
        self._out, self._in = _connect(comm, self.p, self.r, ports, self.ranks)
        self.hosts = comm.allgather(socket.gethostname())
        self._threads = [threading.Thread(target=target, name=f"dtrun-ring-{name}", daemon=True)
                         for target, name in ((self._sender, "send"), (self._receiver, "receive"))]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ caller side
    def submit(self, flat: np.ndarray, finish: Callable[[np.ndarray], None] | None = None) -> _Job:
        """Start reducing ``flat`` (1-D, C-contiguous, summed in place; ``finish`` runs on
        each reduced chunk before it is shared, e.g. an average's division)."""
        if self._broken is not None:
            raise self._failure(self._broken)
        p = self.p
        job = _Job(self._seq, flat, _signature(flat), p,
                   max(1, self._chunk_bytes // flat.itemsize), finish)
        self._seq += 1
        if p == 1:
            if finish is not None and flat.size:
                finish(flat)
            job.done.set()
            return job
        first = job.chunks(self.r)
        job.left = sum(len(job.chunks(k)) for k in range(p) if k != self.r)  # reduce-scatter
        job.left += sum(len(job.chunks(k)) for k in range(p) if k != (self.r + 1) % p)  # gather
        with self._cv:
            gone = self._left_gone
            if gone is None:
                self._jobs[job.seq] = job
                self._cv.notify_all()
        if gone is not None:  # nothing more comes from the previous rank: the next rank,
            self._break(gone)  # which waits for this one, must fail too, not hang
            raise gone
        for c, (i, j) in enumerate(first):
            self._queue(job, 0, c, i, j)
        with self._cv:  # an empty bucket has nothing to send or receive
            self._maybe_done(job)
        return job

    def wait(self, job: _Job) -> None:
        job.done.wait()
        if job.error is not None:
            raise self._failure(job.error)

    def _failure(self, e: BaseException) -> RingError:
        if isinstance(e, RingError):
            return e
        return RingError("allreduce", self.me, f"the ring between hosts failed: {e}")

    # ------------------------------------------------------------------ the two threads
    def _queue(self, job: _Job, step: int, c: int, i: int, j: int) -> None:
        with self._cv:
            job.unsent += 1
        self._sendq.put((job, step, c, i, j))

    def _sender(self) -> None:
        right = (self.r + 1) % self.p
        try:
            while True:
                item = self._sendq.get()
                if item is None:  # close(): this thread ends before the sockets do
                    return
                job, step, c, i, j = item
                view = memoryview(job.flat[i:j]).cast("B")
                self._out.sendall(_HDR.pack(job.seq, step, c, view.nbytes, job.sig),
                                  socket.MSG_MORE)
                self._out.sendall(view)
                with self._cv:
                    job.unsent -= 1
                    self._maybe_done(job)
        except OSError as e:
            self._break(RingError("allreduce", self.me, f"the connection to rank {self.ranks[right]} on "
                                  f"{self.hosts[right]} broke ({e.strerror or e}); it ended "
                                  "or failed"))
        except BaseException as e:  # noqa: BLE001 - handed to every waiter
            self._break(e)

    def _receiver(self) -> None:
        hdr = bytearray(_HDR.size)
        try:
            while True:
                try:
                    self._recv_into(memoryview(hdr), between=True)
                except _PeerClosed as e:
                    if self._left_done(e):
                        return
                    raise RingError(e.op, e.rank, e.problem) from None
                seq, step, c, nbytes, sig = _HDR.unpack(hdr)
                job = self._job(seq)
                self._take(job, step, c, nbytes, sig)
        except BaseException as e:  # noqa: BLE001 - handed to every waiter
            self._break(e)

    def _left_done(self, e: RingError) -> bool:
        """The previous rank closed its connection between chunks. When no bucket awaits
        anything more from it, that rank is done and closed its ring (it had all it needed,
        so it had sent all it owed): not a failure. A bucket here may still be waiting only
        for its own last send to return, and finishes; a later ``submit`` fails."""
        with self._cv:
            if self._broken is not None or any(job.left for job in self._jobs.values()):
                return False
            self._left_gone = RingError(e.op, e.rank, e.problem)
            return True

    def _job(self, seq: int) -> _Job:
        with self._cv:
            while seq not in self._jobs and self._broken is None:
                self._cv.wait()
            if self._broken is not None:
                raise self._broken
            return self._jobs[seq]

    def _take(self, job: _Job, step: int, c: int, nbytes: int, sig: int) -> None:
        """One chunk from the previous rank: reduce it (reduce-scatter steps) or land it
        (allgather steps), then pass it on if the ring still needs it."""
        p, r = self.p, self.r
        gather = step >= p - 1
        part = (r - step + p - 1) % p if gather else (r - step - 1) % p
        spans = job.chunks(part)
        if sig != job.sig or not 0 <= c < len(spans) or \
                nbytes != (spans[c][1] - spans[c][0]) * job.flat.itemsize or step > 2 * p - 3:
            left = (r - 1) % p
            raise RingMismatchError(
                "allreduce", self.me, f"bucket #{job.seq} differs between ranks: rank "
                f"{self.ranks[left]} on {self.hosts[left]} has {_describe(sig)}, rank {self.me} has "
                f"{_describe(job.sig)}; every rank must reduce the same buckets in the "
                "same order")
        i, j = spans[c]
        dst = job.flat[i:j]
        if gather:
            self._recv_into(memoryview(dst).cast("B"))
        else:
            tmp = self._scratch[:nbytes].view(job.flat.dtype)
            self._recv_into(memoryview(tmp).cast("B"))
            self._add(dst, tmp)
            if step == p - 2 and job.finish is not None:
                job.finish(dst)
        if step < 2 * p - 3:
            self._queue(job, step + 1, c, i, j)
        with self._cv:
            job.left -= 1
            self._maybe_done(job)

    def _maybe_done(self, job: _Job) -> None:
        if job.left == 0 and job.unsent == 0 and not job.done.is_set():
            self._jobs.pop(job.seq, None)
            job.done.set()

    def _recv_into(self, view: memoryview, between: bool = False) -> None:
        got, n = 0, view.nbytes
        while got < n:
            k = self._in.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            if k == 0:
                left = (self.r - 1) % self.p
                kind = _PeerClosed if between and got == 0 else RingError  # between chunks?
                raise kind("allreduce", self.me, f"rank {self.ranks[left]} on {self.hosts[left]} "
                           "closed the ring's connection (it ended or failed)")
            got += k

    def _break(self, e: BaseException) -> None:
        with self._cv:
            first = self._broken is None
            if first:
                self._broken = e
            for job in self._jobs.values():
                job.error = self._broken
                job.done.set()
            self._cv.notify_all()
        if first:  # the neighbours see the connections close, and fail in turn
            self._shutdown()

    def _shutdown(self) -> None:
        for s in (self._out, self._in):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Close the connections (the other ranks' pending waits then fail).

        The two threads end first, and only then are the sockets closed: a thread that
        still held a socket's number when it was closed could meet that number again in
        the next ring's socket, and read (steal) that ring's bytes. A thread that does not
        end in time keeps its sockets open (they close with it) rather than risk that."""
        with self._cv:
            if self._broken is None:
                self._broken = RingError("allreduce", self.me, "the ring was closed")
            self._cv.notify_all()  # a receiver waiting for a bucket's submit
        self._shutdown()  # a receiver blocked in recv returns, a sender in sendall fails
        self._sendq.put(None)  # a sender waiting for work ends
        end = time.monotonic() + CLOSE_TIMEOUT_S
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            return
        for s in (self._out, self._in):
            s.close()


# ---------------------------------------------------------------------- connection setup
def _connect(comm: Any, p: int, r: int, ports: tuple[int, int] | None,
             ranks: list[int]) -> tuple[socket.socket, socket.socket]:
    """Connect to the next rank and accept the previous one; every rank learns whether
    all of them succeeded (a RingError on every rank otherwise, naming the first)."""
    include = os.environ.get("OMPI_MCA_btl_tcp_if_include")
    # Loopback only when the host has nothing else (then every rank is on this host).
    mine = _local_networks(include) or _local_networks(None) or \
        [ipaddress.IPv4Interface("127.0.0.1/8")]
    listener, why = _listen(ports)
    token = comm.bcast(secrets.token_bytes(16) if r == 0 else None, root=0)
    table = comm.allgather(([str(m.ip) for m in mine],
                            listener.getsockname()[1] if listener else 0, why))
    deaf = [(i, w) for i, (_, _, w) in enumerate(table) if w]
    if deaf:  # the same table on every rank: the same decision, no more collectives
        if listener is not None:
            listener.close()
        raise RingError("allreduce", ranks[r], f"rank {ranks[deaf[0][0]]} could not join the ring between "
                        f"hosts: {deaf[0][1]}")
    out = inp = None
    problem = ""
    inp_box: dict = {}
    acceptor = threading.Thread(target=_accept, args=(listener, token, (r - 1) % p, inp_box,
                                                      ranks[(r - 1) % p]), daemon=True)
    acceptor.start()
    try:
        addrs, port, _ = table[(r + 1) % p]
        out, problem = _dial(_order_for(addrs, mine), port, token, r)
        acceptor.join(CONNECT_TIMEOUT_S + 1)
        inp = inp_box.get("sock")
        if out is not None and inp is None:
            problem = inp_box.get("problem", "the previous rank did not connect in time")
    finally:
        # Closed only once the acceptor has ended (it has a deadline of its own): a socket
        # number closed under a thread that still uses it may come back as another socket.
        if not acceptor.is_alive():
            listener.close()
    problems = comm.allgather(problem if (out is None or inp is None) else "")
    bad = [(i, m) for i, m in enumerate(problems) if m]
    if bad:
        for s in (out, inp):
            if s is not None:
                s.close()
        i, m = bad[0]
        raise RingError("allreduce", ranks[r], f"rank {ranks[i]} could not join the ring between "
                        f"hosts: {m}")
    for s in (out, inp):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(None)
    return out, inp


def _listen(ports: tuple[int, int] | None) -> tuple[socket.socket | None, str]:
    """A listening socket on any port, or on the first free one of ``ports``."""
    candidates = range(ports[0], ports[1] + 1) if ports else (0,)
    for port in candidates:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # a fixed port is free again at once after a job (its connections' TIME_WAIT)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))
            s.listen(64)
            return s, ""
        except OSError:
            s.close()
    return None, f"no free port in DTRUN_DP_RING_PORTS={ports[0]}-{ports[1]}" if ports else \
        "could not listen on any port"


def _dial(addrs: list[str], port: int, token: bytes, r: int) -> tuple[socket.socket | None, str]:
    errors = []
    for a in addrs:
        try:
            s = socket.create_connection((a, port), timeout=CONNECT_TIMEOUT_S)
            s.sendall(_HELLO.pack(token, r))
            return s, ""
        except OSError as e:
            errors.append(f"{a}:{port}: {e.strerror or e}")
    return None, "; ".join(errors) or "the next rank published no address"


def _accept(listener: socket.socket, token: bytes, left: int, box: dict,
            label: int | None = None) -> None:
    """Accept the previous rank's connection: the first that presents the ring's token
    and the expected rank. Anything else (a stranger, garbage, a silent or slow hello) is
    closed without holding up the others (``handshake.admit``)."""
    def judge(s: socket.socket, hello: bytes) -> int | None:
        their_token, their_rank = _HELLO.unpack(hello)
        return their_rank if hmac.compare_digest(their_token, token) else None

    found = admit(listener, _HELLO.size, judge, {left}, CONNECT_TIMEOUT_S)
    if left in found:
        box["sock"] = found[left]
    else:
        box["problem"] = (f"rank {left if label is None else label} did not connect within "
                          f"{CONNECT_TIMEOUT_S:.0f} s")
