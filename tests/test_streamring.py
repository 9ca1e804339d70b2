"""dtrun.collectives.streamring (the TCP ring that carries data-parallel buckets between hosts):
exact results on real ranks, mismatches and closed connections as errors on every rank
(never a wrong sum, never a hang), and who may join the ring. tests/ring_cases.py is the
rank program; the data-parallel layer over namespace hosts is in tests/test_dp.py."""

from __future__ import annotations

import re
import socket
import sys
import threading
import time

import pytest

from dtrun.collectives import streamring
from tests.dtrun_helpers import REPO, dtrun, result_records

PYTHON = sys.executable
CASES = str(REPO / "tests" / "ring_cases.py")


def _results(n: int, mode: str, *forward: str) -> list[dict]:
    forwards = [x for name in forward for x in ("-x", name)]
    p = dtrun("-np", n, "-H", f"localhost:{n}", "--oversubscribe", *forwards, PYTHON, CASES,
              mode, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    found = sorted(result_records(p.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in found] == list(range(n)), p.stdout[-3000:] + p.stderr[-3000:]
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_every_size_and_dtype_is_exact_and_identical_on_every_rank(n):
    res = _results(n, "exact")
    for r in res:
        assert r["bad"] == [], r
        assert r["identical"], r
    # ``finish`` (an average's division) runs exactly once on every element, somewhere
    assert sum(r["finished"] for r in res) == res[0]["total"]


@pytest.mark.mpi
def test_a_bucket_that_differs_is_an_error_on_every_rank_naming_both_sizes():
    res = _results(3, "mismatch")
    assert all(r["error"] for r in res), res  # nobody returned a sum
    host = socket.gethostname()
    # rank 1 (odd size) sees it first from rank 0, rank 2 from rank 1; which of the two gets
    # there first is a race, and whoever does not closes the ring on the rest
    expected = {1: f"allreduce on rank 1: bucket #0 differs between ranks: rank 0 on {host} "
                   "has 100001 float32 elements, rank 1 has 100002 float32 elements; every rank "
                   "must reduce the same buckets in the same order",
                2: f"allreduce on rank 2: bucket #0 differs between ranks: rank 1 on {host} "
                   "has 100002 float32 elements, rank 2 has 100001 float32 elements; every rank "
                   "must reduce the same buckets in the same order"}
    named = {r["rank"]: r["error"] for r in res if "differs between ranks" in r["error"]}
    assert named and all(expected[k] == v for k, v in named.items()), res


@pytest.mark.mpi
def test_a_rank_that_leaves_fails_the_others_instead_of_hanging():
    res = _results(3, "peer-closes")
    host = re.escape(socket.gethostname())
    assert res[1]["error"] is None
    # each of the others sees a connection of its own close or break: rank 1's, or the next
    # one's as the failure travels round the ring (which comes first is a race)
    for r in (0, 2):
        assert re.fullmatch(rf"allreduce on rank {r}: (rank [0-2] on {host} closed the ring's "
                            rf"connection \(it ended or failed\)|the connection to rank [0-2] on "
                            rf"{host} broke \([^)]+\); it ended or failed)", res[r]["error"]), res
    assert any("rank 1" in res[r]["error"] for r in (0, 2)), res


def _free_port_pair() -> int:
    import random

    for _ in range(200):
        low = random.randrange(47400, 47900)
        try:
            for port in (low, low + 1):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
            return low
        except OSError:
            continue
    pytest.skip("no two free ports in a row in 47400-47900")


@pytest.mark.mpi
def test_fixed_ports_are_free_again_at_once_for_the_next_ring():
    # DTRUN_DP_RING_PORTS with one port per rank: the next job (here the next ring) must
    # listen on them again at once, while the last one's connections are in TIME_WAIT.
    low = _free_port_pair()
    res = _results(2, "same-ports", f"RING_TEST_PORTS={low}-{low + 1}")
    assert [r["rounds"] for r in res] == [[2.0, 2.0], [2.0, 2.0]], res


@pytest.mark.mpi
def test_a_neighbour_that_is_done_and_closes_first_fails_no_bucket():
    # Rank 1 has all it needs as soon as rank 0's last send is in the kernel, and closes;
    # rank 0's sender has not yet returned from that send. Rank 0's bucket must finish,
    # and only a bucket after it fail (a RingError, never a hang).
    res = _results(2, "done-first")
    host = socket.gethostname()
    assert [(r["rank"], r["error"], r["exact"]) for r in res] == [(0, None, True), (1, None, True)]
    assert res[0]["later"] == (f"RingError: allreduce on rank 0: rank 1 on {host} closed the ring's "
                               "connection (it ended or failed)"), res


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_rings_closed_after_their_last_bucket_and_opened_again_at_once(n):
    # As the runtime's stream path does when a Comm is freed and another made: every sum
    # right on every rank, and no ring thread left behind by close() (one that outlived
    # it could still be using a socket number that the next ring is given).
    res = _results(n, "reopen")
    for r in res:
        assert (r["errors"], r["wrong"], r["outlived"]) == ([], 0, 0), r


def test_the_listener_admits_only_the_token_and_rank_it_expects():
    token = b"k" * 16
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)  # as streamring._listen: 11 connections must not overflow the queue
    port = listener.getsockname()[1]
    box: dict = {}
    t = threading.Thread(target=streamring._accept, args=(listener, token, 3, box))
    t.start()
    strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]  # silent
    for hello in (b"GET / HTTP/1.0\r\n\r\n", streamring._HELLO.pack(b"x" * 16, 3),
                  streamring._HELLO.pack(token, 2), b"\0"):  # no token, wrong token,
        s = socket.create_connection(("127.0.0.1", port))  # wrong rank, a slow start
        s.sendall(hello)
        strangers.append(s)
    began = time.monotonic()
    good = socket.create_connection(("127.0.0.1", port))
    good.sendall(streamring._HELLO.pack(token, 3))
    t.join(15)
    assert "sock" in box, box
    assert time.monotonic() - began < 1.0  # the silent and the slow did not hold it up
    accepted = box["sock"]
    good.sendall(b"ping")
    assert accepted.recv(4) == b"ping"  # the one admitted is the one with the token
    for s in strangers:  # the others were closed
        s.settimeout(5)
        assert s.recv(1) == b""
    for s in (*strangers, good, accepted, listener):
        s.close()


def test_peer_addresses_on_a_shared_subnet_come_first():
    import ipaddress

    mine = [ipaddress.IPv4Interface("10.95.0.11/24")]
    assert streamring._order_for(["172.17.0.1", "10.95.0.12", "192.168.1.5"], mine) == \
        ["10.95.0.12", "172.17.0.1", "192.168.1.5"]


def test_btl_tcp_if_include_restricts_the_interfaces_by_name_or_cidr():
    import ipaddress

    iface = ipaddress.IPv4Interface("10.95.0.11/24")
    assert streamring._matches("eth0", "eth0", iface)
    assert not streamring._matches("eth1", "eth0", iface)
    assert streamring._matches("10.95.0.0/16", "eth0", iface)
    assert not streamring._matches("10.96.0.0/16", "eth0", iface)
    assert not streamring._matches("not/a-cidr", "eth0", iface)
