"""Admitting a job's own peers on a listening socket that strangers can reach too.

The data-parallel ring's TCP listener (``streamring``) and the host's local socket
(``dp_exchange``) both wait for known peers, each of which connects and at once sends a
fixed-size hello (a secret token sent over MPI, never in a name anyone can list, and who
it is). Anyone who can reach the port or list the socket can connect as well: a foreign,
garbage, silent or slow connection must never take a peer's place, delay it, or make the
job blame a peer that did connect. So every pending connection is read at once, without
blocking the others (one ``select`` over all of them), gets a short deadline of its own
for its hello, and is closed if the hello is wrong or late; the wait ends when every
expected peer has arrived, or at the overall deadline.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import time
from typing import Callable

HELLO_DEADLINE_S = 2.0  # for one connection's hello, from its accept
MAX_PENDING = 64  # connections whose hello is incomplete; beyond it the oldest is dropped

# judge(conn, hello) -> the peer's id, or None: a stranger (the connection is closed)
Judge = Callable[[socket.socket, bytes], "int | None"]


def admit(listener: socket.socket, hello_size: int, judge: Judge, wanted: set[int],
          timeout: float, hello_deadline: float = HELLO_DEADLINE_S) -> dict[int, socket.socket]:
    """Accept on ``listener`` until every id in ``wanted`` has sent a hello that ``judge``
    accepts, or ``timeout`` seconds pass. Returns the admitted connections (blocking
    sockets) by id; a missing id is a peer that truly did not connect."""
    found: dict[int, socket.socket] = {}
    pending: dict[socket.socket, tuple[bytearray, float]] = {}
    sel = selectors.DefaultSelector()
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ)
    end = time.monotonic() + timeout
    try:
        while not wanted <= found.keys():
            now = time.monotonic()
            for s in [s for s, (_, due) in pending.items() if due <= now]:
                _drop(sel, pending, s)
            soonest = min([end, *(due for _, due in pending.values())])
            if now >= end:
                break
            for key, _ in sel.select(max(0.0, soonest - now)):
                if key.fileobj is listener:
                    _take_new(listener, sel, pending, hello_size, hello_deadline)
                else:
                    _read_hello(key.fileobj, sel, pending, hello_size, judge, wanted, found)
    finally:
        for s in list(pending):
            _drop(sel, pending, s)
        sel.close()
    return found


def _take_new(listener: socket.socket, sel, pending: dict, hello_size: int,
              hello_deadline: float) -> None:
    while True:
        try:
            s, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # e.g. too many open files: the others may still come
            return
        if len(pending) >= MAX_PENDING:  # a flood: the oldest incomplete hello goes
            _drop(sel, pending, next(iter(pending)))
        s.setblocking(False)
        pending[s] = (bytearray(), time.monotonic() + hello_deadline)
        sel.register(s, selectors.EVENT_READ)


def _read_hello(s: socket.socket, sel, pending: dict, hello_size: int, judge: Judge,
                wanted: set[int], found: dict) -> None:
    buf, _ = pending[s]
    try:
        got = s.recv(hello_size - len(buf))
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        got = b""
    if not got:
        _drop(sel, pending, s)
        return
    buf += got
    if len(buf) < hello_size:
        return
    sel.unregister(s)
    del pending[s]
    try:
        who = judge(s, bytes(buf))
    except (OSError, ValueError, struct.error):
        who = None
    if who is None or who not in wanted or who in found:
        s.close()
        return
    s.setblocking(True)
    found[who] = s


def _drop(sel, pending: dict, s: socket.socket) -> None:
    sel.unregister(s)
    del pending[s]
    s.close()


def peer_uid(s: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def same_user(s: socket.socket) -> bool:
    """Whether the other end of a Unix socket runs as this process's user."""
    return peer_uid(s) == os.geteuid()
