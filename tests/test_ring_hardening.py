"""The data-parallel exchange between hosts against strangers and failures, on namespace
hosts: another local user who lists the host's local socket or finds the ring's ports
can neither join the job nor harm it nor make it blame a peer; a rank that truly did not
connect is the one named; a ring that cannot connect falls back with several ranks per
host too; a ring that breaks is named on every rank. tests/exchange_cases.py is the rank
program, tests/ring_intruder.py the stranger."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.dtrun_helpers import REPO, dtrun, ports_dropped, result_records, the_one_line

PYTHON = sys.executable
CASES = str(REPO / "tests" / "exchange_cases.py")
INTRUDER = str(REPO / "tests" / "ring_intruder.py")
STRANGER_UID = 4242
PORTS = "47300-47310"



def _stranger_uid() -> int:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to act as another local user")
    if subprocess.run(["id", str(STRANGER_UID)], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-u", str(STRANGER_UID), "-M", "-N", "dtother"], check=True)
    return STRANGER_UID


@pytest.fixture
def gate_dir():
    folder = tempfile.mkdtemp(prefix="dtrun-gates-")
    os.chmod(folder, 0o1777)  # the stranger writes there too
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _run(cluster, spec: str, mode: str, *env: str, timeout: float = 120):
    forwards = [x for pair in (("-x", e) for e in env) for x in pair]
    return dtrun("--ssh-config", cluster.ssh_config, "-H", spec, *forwards, PYTHON, CASES,
                 mode, timeout=timeout)


def _results(p) -> list[dict]:
    found = result_records(p.stdout)
    return sorted(found, key=lambda r: r["rank"])


def _fell_back_exactly(p) -> str:
    """The one line saying the job went through MPI instead of the ring, after checking the job
    ended well and every rank trained exactly (on the runtime)."""
    said = the_one_line(p, "dtrun.collectives.dp:")
    res = _results(p)
    assert [(r["transport"], r["bad"]) for r in res] == [("runtime", [])] * 3, res
    return said


def _stranger(cluster, host, uid: int, *args: str) -> subprocess.Popen:
    who = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return cluster.popen(host, [*who, PYTHON, INTRUDER, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd="/")


def _report(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=90)
    lines = [ln for ln in out.splitlines() if ln.startswith("INTRUDER ")]
    assert lines, err[-2000:]
    return json.loads(lines[-1][len("INTRUDER "):])


def _exact_on_the_ring(p, n: int) -> list[dict]:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "dtrun.collectives.dp:" not in p.stdout + p.stderr, p.stderr[-3000:]  # no fallback
    res = _results(p)
    assert [r["rank"] for r in res] == list(range(n)), p.stdout[-3000:]
    assert all(r["transport"] == "ring" and r["bad"] == [] for r in res), res
    return res


@pytest.mark.cluster
@pytest.mark.mpi
def test_a_stranger_who_lists_the_local_socket_can_neither_join_nor_harm_the_job(cluster3,
                                                                                 gate_dir):
    # Ranks 0 and 1 share h1 (rank 1 waits for its leader on the local socket). Another
    # user on h1 reads the socket's name from /proc/net/unix and connects first, as a
    # peer would, with the name as the token, garbage, nothing, and a slow hello; so
    # does this user's own process (same uid: only the token keeps it out).
    uid = _stranger_uid()
    h1, h2 = cluster3.hosts[:2]
    strangers = [_stranger(cluster3, h1, u, "unix", gate_dir, str(u)) for u in (uid, 0)]
    p = _run(cluster3, f"{h1.name}:2,{h2.name}:1", "exact", "DTRUN_TEST_GATES=unix=2",
             f"DTRUN_TEST_GATE_DIR={gate_dir}")
    seen = [_report(s) for s in strangers]
    res = _exact_on_the_ring(p, 3)
    assert seen[0]["uid"] == uid and seen[0]["names"], seen  # it did list the socket ...
    assert "the name as token" in seen[0]["tried"], seen  # ... and connect to it
    (hello,) = res[1]["hello"]  # what rank 1 sent its leader: the secret is in it ...
    for name in seen[0]["names"] + seen[1]["names"]:  # ... and in no name anyone can list
        random_part = name[len("@dtrun-dp-"):]
        assert random_part not in bytes.fromhex(hello).decode("latin-1"), (name, hello)
        assert random_part not in hello, (name, hello)


@pytest.mark.cluster
@pytest.mark.mpi
def test_strangers_on_the_ring_ports_are_dropped_without_blaming_a_peer(cluster3, gate_dir):
    # On both hosts' ring ports: garbage, a wrong token, a hello one byte every 0.5 s and
    # eight silent connections, all before the real peer connects. Each is dropped on
    # its own deadline while the real peer is admitted at once.
    uid = _stranger_uid()
    h1, h2 = cluster3.hosts[:2]
    stranger = _stranger(cluster3, h1, uid, "tcp", gate_dir, "s", f"127.0.0.1:{PORTS}",
                         f"{h2.addr}:{PORTS}")
    p = _run(cluster3, f"{h1.name}:1,{h2.name}:1", "exact", f"DTRUN_DP_RING_PORTS={PORTS}",
             "DTRUN_TEST_GATES=tcp=1", f"DTRUN_TEST_GATE_DIR={gate_dir}")
    seen = _report(stranger)
    _exact_on_the_ring(p, 2)
    assert sum(w.startswith("silent") for w in seen["tried"]) == 16, seen  # both listeners


@pytest.mark.cluster
@pytest.mark.mpi
def test_a_rank_that_never_reaches_its_leader_is_the_one_named(cluster3):
    # Rank 1 connects to its host's leader (rank 0) only after the leader's 10 s: the job
    # goes on through MPI, and the one line names rank 1, not the leader.
    h1, h2 = cluster3.hosts[:2]
    p = _run(cluster3, f"{h1.name}:2,{h2.name}:1", "late")
    said = _fell_back_exactly(p)
    assert said.endswith("dtrun.collectives.dp: rank 1 did not connect to its host's leader, "
                         "rank 0, within 10 s; gradients go through MPI between hosts instead"), said


@pytest.mark.cluster
@pytest.mark.mpi
def test_a_ring_that_cannot_connect_falls_back_with_several_ranks_per_host(cluster3):
    # h2 drops the ring's ports: the leaders' ring fails, and h1's other rank, waiting to
    # hear whether its leader's ring is up, must not be left in a collective of its own.
    h1, h2 = cluster3.hosts[:2]
    with ports_dropped(cluster3, h2, PORTS):
        p = _run(cluster3, f"{h1.name}:2,{h2.name}:1", "exact",
                 f"DTRUN_DP_RING_PORTS={PORTS}", timeout=90)
    said = _fell_back_exactly(p)
    assert "rank 0 could not join the ring between hosts" in said, said


@pytest.mark.cluster
@pytest.mark.mpi
def test_the_runtimes_stream_path_across_hosts_and_its_fallback_when_the_ring_is_blocked(
        cluster3):
    # The runtime's own allreduce along the streaming ring between real hosts: exact, with
    # 2 ranks on h1. Then h2 drops the ring's ports: rank 0 says so in one line, and every
    # call takes MPI's allreduce instead, exact too.
    h1, h2 = cluster3.hosts[:2]
    env = ("DTRUN_ALLREDUCE_PATH=stream", f"DTRUN_DP_RING_PORTS={PORTS}")
    p = _run(cluster3, f"{h1.name}:2,{h2.name}:1", "stream", *env, timeout=90)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "dtrun.collectives" not in p.stdout + p.stderr, p.stderr[-3000:]
    res = _results(p)
    assert [(r["transport"], r["path"], r["bad"]) for r in res] == [("stream", "stream", [])] * 3
    with ports_dropped(cluster3, h2, PORTS):
        p = _run(cluster3, f"{h1.name}:1,{h2.name}:1", "stream", *env, timeout=90)
    said = the_one_line(p, "dtrun.collectives")
    assert re.search(rf"dtrun\.collectives: rank 0 could not join the ring between hosts: "
                     rf"{re.escape(h2.addr)}:473\d\d: timed out; allreduces along the stream path "
                     r"go through MPI between hosts instead$", said), said
    res = _results(p)
    assert [(r["transport"], r["bad"]) for r in res] == [("mpi", [])] * 2, res


@pytest.mark.cluster
@pytest.mark.mpi
def test_a_ring_that_breaks_is_named_on_every_rank_of_the_host(cluster3):
    # Rank 2 (alone on h2) closes its ring: rank 0 sees it, and rank 1 (on h1, waiting for
    # its leader) learns the same cause, naming rank 2, not just "the leader failed".
    h1, h2 = cluster3.hosts[:2]
    p = _run(cluster3, f"{h1.name}:2,{h2.name}:1", "peer-closes")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = {r["rank"]: r["error"] for r in _results(p)}
    cause = (rf"(rank 2 on {re.escape(h2.name)} closed the ring's connection \(it ended or "
             rf"failed\)|the connection to rank 2 on {re.escape(h2.name)} broke \([^)]+\); it "
             r"ended or failed)")
    assert res[2] is None, res
    assert re.fullmatch(rf"allreduce on rank 0: {cause}", res[0]), res
    assert re.fullmatch(rf"allreduce on rank 1: the ring between hosts failed on this host's "
                        rf"leader, rank 0: {cause}", res[1]), res


class _Host:
    """A host's communicator of two ranks, as the leader's _Bell sees it (the test is rank 1)."""

    def __init__(self) -> None:
        import threading

        self.secret = None
        self.listening = threading.Event()

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 2

    def allgather(self, rank):
        return [rank, 1]

    def bcast(self, value, root=0):
        self.secret = value
        return value

    def Barrier(self) -> None:
        self.listening.set()


def test_another_user_with_the_token_still_cannot_take_a_ranks_place():
    # Even a stranger who somehow had the token is refused by user id (SO_PEERCRED), and
    # the real rank, connecting after it, is admitted.
    import socket
    import threading

    from dtrun.collectives import dp_exchange

    uid = _stranger_uid()
    host, box = _Host(), {}
    t = threading.Thread(target=lambda: box.update(bell=dp_exchange._Bell(host, 0, up=True)))
    t.start()
    assert host.listening.wait(10)
    name, token = host.secret
    hello = dp_exchange._BELL_HELLO.pack(token, 1).hex()
    stranger = ("import socket, sys; s = socket.socket(socket.AF_UNIX); "
                "s.connect('\\0' + sys.argv[1]); s.sendall(bytes.fromhex(sys.argv[2])); "
                "s.settimeout(5); print('dropped' if s.recv(1) == b'' else 'kept')")
    p = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", PYTHON,
                        "-c", stranger, name[1:], hello], capture_output=True, text=True,
                       timeout=30, cwd="/")
    assert p.stdout.strip() == "dropped", p.stdout + p.stderr
    me = socket.socket(socket.AF_UNIX)
    me.connect(name)
    me.sendall(bytes.fromhex(hello))
    t.join(15)
    bell = box["bell"]
    assert len(bell.peers) == 1
    bell.ring(ok=True)
    assert me.recv(1) == b"."
    bell.close()
    me.close()
