"""dtrun.collectives.dp_exchange (the ring between hosts and each host's local socket) under a
real job on namespace hosts, one behaviour per mode (tests/test_ring_hardening.py).

Usage: python tests/exchange_cases.py MODE   (under dtrun; prints ``RESULT {json}``)

Modes:
  exact     open the exchange and reduce buckets of several sizes and dtypes: each
            equals MPI's allreduce. With DTRUN_TEST_GATE_DIR and DTRUN_TEST_GATES
            (e.g. ``unix=2,tcp=1``), each rank first waits at its connections, the ring's
            (tcp) and the local socket's (unix), until that many strangers
            (tests/ring_intruder.py) wrote PHASE.* there, so they are first in line; a
            rank that is not its host's leader reports the hello it sent its leader
  late      rank 1 (not its host's leader) connects to its leader only after the
            leader's deadline: the job falls back to MPI, and the line names rank 1
  peer-closes
            the last rank (alone on its host) closes its ring instead of taking part:
            every other rank's wait fails, naming it, also on its host's other ranks
  stream    the runtime's own allreduce along its ``stream`` path (run it with
            DTRUN_ALLREDUCE_PATH=stream): each result equals MPI's allreduce; reports
            whether the path's ring opened
"""

from __future__ import annotations

import glob
import json
import os
import socket
import sys
import time

import numpy as np

from dtrun import collectives
from dtrun.collectives import dp_exchange, streamring
from dtrun.collectives.streamring import RingError

SIZES = (1, 3, 1000, 65537, 300_001)
DTYPES = ("float32", "float64", "int64")
_REAL_CONNECT = socket.socket.connect
_REAL_SENDALL = socket.socket.sendall
_HELLO_FDS: set[int] = set()
SENT: list[bytes] = []


def report(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _wait_gate(phase: str) -> None:
    gates = dict(g.split("=") for g in os.environ.get("DTRUN_TEST_GATES", "").split(",") if g)
    need, folder = int(gates.get(phase, 0)), os.environ.get("DTRUN_TEST_GATE_DIR", "")
    end = time.monotonic() + 30
    while need and time.monotonic() < end and \
            len(glob.glob(os.path.join(folder, f"{phase}.*"))) < need:
        time.sleep(0.02)


def _is_bell(sock, address) -> bool:
    return sock.family == socket.AF_UNIX and isinstance(address, (str, bytes)) and \
        str(address).lstrip("\0").startswith("dtrun-dp")


def _connect(self, address):  # every connection to the local socket, whatever the code
    if _is_bell(self, address):
        _wait_gate("unix")
        if os.environ.get("EXCHANGE_LATE") == "1":
            time.sleep(12)  # past the leader's 10 s
        _HELLO_FDS.add(self.fileno())
    return _REAL_CONNECT(self, address)


def _sendall(self, data, *args):
    if self.fileno() in _HELLO_FDS:
        _HELLO_FDS.discard(self.fileno())
        SENT.append(bytes(data))
    return _REAL_SENDALL(self, data, *args)


def _gated_dial(real):
    def dial(*args, **kwargs):
        _wait_gate("tcp")
        return real(*args, **kwargs)
    return dial


def open_exchange(comm):
    socket.socket.connect = _connect
    socket.socket.sendall = _sendall
    streamring._dial = _gated_dial(streamring._dial)
    return dp_exchange.open_exchange(comm, lambda d, s: np.add(d, s, out=d),
                                     lambda x, f: np.multiply(x, f, out=x, casting="unsafe"),
                                     lambda d, s: np.copyto(d, s, casting="unsafe"))


def exact(comm, ex) -> None:
    rng = np.random.default_rng(7 + comm.rank)
    bad = []
    for dt in DTYPES:
        for n in SIZES:
            x = (rng.standard_normal(n) * 100).astype(dt)
            want = np.empty_like(x)
            comm.mpi.Allreduce(x, want)
            if ex is not None:
                ex.wait(ex.start(x, None), x)
            else:
                comm.mpi.Allreduce(x.copy(), x)
            ok = np.array_equal(x, want) if x.dtype.kind == "i" else \
                np.allclose(x, want, rtol=1e-6, atol=1e-6)
            if not ok:
                bad.append(f"{dt}[{n}]")
    report(rank=comm.rank, transport="ring" if ex is not None else "runtime", bad=bad,
           hello=[h.hex() for h in SENT])


def peer_closes(comm, ex) -> None:
    last = comm.size - 1
    if comm.rank == last:
        ex.ring.close()
        report(rank=last, error=None)
        return
    x = np.ones(1_000_000, np.float32)
    try:
        ex.wait(ex.start(x, None), x)
        report(rank=comm.rank, error=None)
    except RingError as e:
        report(rank=comm.rank, error=str(e))


def stream(comm) -> None:
    bad = []
    for dt in DTYPES:
        for n in SIZES:
            x = (np.arange(n) % 7 + comm.rank).astype(dt)
            want = np.empty_like(x)
            comm.mpi.Allreduce(x, want)
            if not np.array_equal(comm.allreduce(x), want):
                bad.append(f"{dt}[{n}]")
            comm.allreduce(x, inplace=True)
            if not np.array_equal(x, want):
                bad.append(f"{dt}[{n}] in place")
    report(rank=comm.rank, transport="stream" if comm._stream else "mpi", bad=bad,
           path=comm.allreduce_path(1))


def main(mode: str) -> None:
    comm = collectives.init()
    if mode == "stream":
        stream(comm)
        comm.mpi.Barrier()
        return
    if mode == "late" and comm.rank == 1:
        os.environ["EXCHANGE_LATE"] = "1"
    ex = open_exchange(comm)
    {"exact": exact, "late": exact, "peer-closes": peer_closes}[mode](comm, ex)
    sys.stdout.flush()
    comm.mpi.Barrier()


if __name__ == "__main__":
    main(sys.argv[1])
