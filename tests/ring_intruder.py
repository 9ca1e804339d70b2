"""A local stranger who attacks a data-parallel job's sockets while the job sets them up
(tests/test_ring_hardening.py runs it, as another user, on a namespace host).

Usage: python tests/ring_intruder.py PHASE GATE_DIR TAG [ADDR:LOW-HIGH ...]

PHASE ``unix``: waits for the job's local socket (a ``@dtrun-dp-`` name in
/proc/net/unix, which any user may read), then connects to it as peers do and presents
what a stranger has: the name's random part as the token (the exact bytes a peer sent
when the name carried the token), garbage, nothing at all (held open), and a hello one
byte at a time. PHASE ``tcp``: the same against every ring port listening in each
``ADDR:LOW-HIGH`` (garbage, a wrong token, a slow hello, eight silent connections).

Either way it then writes ``GATE_DIR/PHASE.TAG`` (the job's ranks wait for it before
connecting, so the strangers are first in line), goes on three seconds more, and prints
``INTRUDER {json}``: its user id, the names it listed and what it tried.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

SLOW = ([b"a"] + [b""] * 4) * 40  # a hello one byte every 0.5 s

def listed_names() -> list[str]:
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sorted({r[7] for r in rows if len(r) >= 8 and r[7].startswith("@dtrun-dp-")})


def wait_for(find, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = find()
        if found:
            return found
        time.sleep(0.02)
    return find()


def unix_attacks(names: list[str]) -> list[tuple[str, socket.socket, list[bytes]]]:
    out = []
    for name in names:
        secret = name[len("@dtrun-dp-"):]
        guess = bytes.fromhex(secret.ljust(32, "0")[:32]) if _is_hex(secret) else b"x" * 16
        for what, parts in (("the name as token", [secret.encode()]),
                            ("the name's bytes as token", [guess + (1).to_bytes(4, "little")]),
                            ("garbage", [b"\xff" * 64]), ("silent", []),
                            ("slow", SLOW)):
            s = _try(lambda: _unix(name))
            if s is not None:
                out.append((what, s, parts))
    return out


def tcp_attacks(targets: list[tuple[str, int]]) -> list[tuple[str, socket.socket, list[bytes]]]:
    out = []
    for addr, port in targets:
        plans = [("garbage", [b"GET / HTTP/1.0\r\n\r\n" * 3]), ("wrong token", [os.urandom(20)]),
                 ("slow", SLOW)] + [("silent", [])] * 8
        for what, parts in plans:
            s = _try(lambda: socket.create_connection((addr, port), timeout=2))
            if s is not None:
                out.append((f"{what} {addr}:{port}", s, parts))
    return out


def listening(spec: list[str]) -> list[tuple[str, int]]:
    found = []
    for item in spec:
        addr, _, ports = item.rpartition(":")
        low, high = map(int, ports.split("-"))
        for port in range(low, high + 1):
            s = _try(lambda: socket.create_connection((addr, port), timeout=0.5))
            if s is not None:
                s.close()
                found.append((addr, port))
    return found


def play(conns, seconds: float) -> None:
    """Send each connection's parts, one every 0.1 s (a slow hello takes 4 s)."""
    end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < end:
        for _, s, parts in conns:
            if step < len(parts):
                _try(lambda: s.sendall(parts[step]))
        step += 1
        time.sleep(0.1)


def main(phase: str, gate_dir: str, tag: str, spec: list[str]) -> None:
    if phase == "unix":
        names = wait_for(listed_names)
        conns = unix_attacks(names)
    else:
        names = []
        conns = tcp_attacks(wait_for(lambda: _all_up(listening(spec), len(spec))))
    play(conns, 1.0)  # the first parts, then the ranks may connect
    with open(os.path.join(gate_dir, f"{phase}.{tag}"), "w") as f:
        f.write("done\n")
    play(conns, 3.0)
    for _, s, _ in conns:
        s.close()
    report = {"uid": os.getuid(), "names": names, "tried": [w for w, _, _ in conns]}
    print("INTRUDER " + json.dumps(report), flush=True)


def _unix(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect("\0" + name[1:])
    except OSError:
        s.close()
        raise
    return s


def _all_up(found: list, need: int) -> list:
    return found if len(found) >= need else []


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdef" for c in text)


def _try(fn):
    try:
        return fn()
    except OSError:
        return None


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
