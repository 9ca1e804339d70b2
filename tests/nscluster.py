"""A real multi-host test cluster on one machine, built from Linux network namespaces.

Every host is a network namespace with its own ``eth0`` on a shared bridge, its own
hostname, its own ``sshd`` and its own firewall; all hosts share the file system, so the
project and its virtual environment sit at the same path everywhere (as MPI expects).
The root namespace (the "launching host") sits on the same subnet as ``gateway``.

Library use::

    with Cluster(3, faults={"h2": {"firewall"}}) as cluster:
        subprocess.run(cluster.ssh_argv("h1") + ["hostname"])   # prints "<prefix>-h1"

CLI (state lives in ``/tmp/dtrun-nscluster``, so ``down`` works from another process)::

    python -m tests.nscluster up 4 [--fault h2=firewall,bad_path] [--cluster-fault docker0]
    python -m tests.nscluster up 65 --deny-ssh h1:h65     # h1's key is not authorised on h65
    python -m tests.nscluster status
    python -m tests.nscluster down [PREFIX | --all]

Non-interactive environment of each host (what ``ssh host CMD`` sees), set with sshd's
``SetEnv`` because sshd builds a session's environment from scratch:

* healthy: ``PATH=<venv>/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin``
  (``<venv>`` is this interpreter's virtual environment, found at run time) and
  ``LD_LIBRARY_PATH=/usr/local/lib`` (harmless, but present, like a node whose admin
  exported a library path);
* ``bad_path``: ``PATH=/usr/bin:/bin`` (no virtual environment);
* ``no_ld_library_path``: ``LD_LIBRARY_PATH`` is not set at all;
* ``other_mpi``: ``PATH=<workdir>/other-mpi/bin:`` + the PATH above, where that directory
  holds ``mpirun``/``mpiexec``/``orterun`` -> ``/usr/bin/orterun`` (Debian's Open MPI
  4.1.4) and ``ompi_info``/``orted`` -> ``/usr/bin``. The venv's Open MPI 5 stays
  reachable by absolute path; only the bare names resolve to another MPI.

Every host also gets ``SHLVL=1``: bash sources ``~/.bashrc`` for commands run by sshd
only in a top-level shell, and root's ``.bashrc`` on developer machines prepends pyenv
or cargo directories to PATH. With ``SHLVL=1`` bash starts at level 2 and skips it, so a
host's environment is exactly the one declared here.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import fcntl
import functools
import ipaddress
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

__all__ = [
    "Host",
    "Cluster",
    "ClusterError",
    "ClusterUnavailable",
    "FAULTS",
    "HOST_FAULTS",
    "CLUSTER_FAULTS",
    "STATE_DIR",
    "VENV_BIN",
    "cluster_unavailable_reason",
    "leftovers",
    "down_all",
    "down_prefix",
]

STATE_DIR = Path(os.environ.get("DTRUN_NSCLUSTER_DIR", "/tmp/dtrun-nscluster"))
MARKER = "dtrun-nscluster"  # tags /etc/hosts lines and root-namespace iptables rules
NETNS_PREFIX = "dtrun-"  # namespace names: dtrun-<host name>
BRIDGE_PREFIX = "dtbr-"
VETH_PREFIX = "dtv-"
HOSTS_FILE = Path("/etc/hosts")
SSHD = "/usr/sbin/sshd"  # sshd re-executes itself and insists on an absolute path

HOST_FAULTS = frozenset({
    "docker0", "firewall", "dead", "blackhole", "bad_path", "no_ld_library_path",
    "changed_hostkey", "unknown_hostkey", "other_mpi", "slow_link",
})
CLUSTER_FAULTS = frozenset({"docker0"})
FAULTS = HOST_FAULTS
_IPTABLES_FAULTS = frozenset({"firewall", "blackhole"})
_NETNS_FAULTS = frozenset({"docker0", "slow_link"}) | _IPTABLES_FAULTS  # set up inside the namespace
# slow_link: a token bucket on the host's eth0 (egress), as tbf is in this kernel and netem is not.
SLOW_LINK_TBF = ("tbf", "rate", "50mbit", "burst", "32kbit", "latency", "400ms")
_SSHD_FAULTS = frozenset({"bad_path", "no_ld_library_path", "other_mpi", "changed_hostkey"})

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BAD_PATH = "/usr/bin:/bin"
HEALTHY_LD_LIBRARY_PATH = "/usr/local/lib"
OTHER_MPI_LINKS = {  # name in <workdir>/other-mpi/bin -> Debian's Open MPI 4.1.4
    "mpirun": "/usr/bin/orterun",
    "mpiexec": "/usr/bin/orterun",
    "orterun": "/usr/bin/orterun",
    "orted": "/usr/bin/orted",
    "ompi_info": "/usr/bin/ompi_info",
}
REPO_ROOT = Path(__file__).resolve().parents[1]


def _venv_bin() -> Path:
    """The bin directory of the virtual environment running this code (CI clones anywhere)."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "bin"
    if (REPO_ROOT / ".venv" / "bin").is_dir():
        return REPO_ROOT / ".venv" / "bin"
    return Path(sys.executable).parent


VENV_BIN = _venv_bin()
HEALTHY_PATH = f"{VENV_BIN}:{SYSTEM_PATH}"

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{1,7}$")  # "dtv-<prefix>-<i>" must fit IFNAMSIZ (15)
_MAX_HOSTS = 99
_CMD_TIMEOUT = 10.0
_SSHD_READY_TIMEOUT = 10.0
# The kernel's ARP table is one table for every namespace: gc_thresh3 (default 1024) caps
# the entries of all hosts together, and past it new neighbours are refused ("neighbor
# table overflow"). N hosts that all talk to each other need about N*N entries: 65 hosts
# connecting all pairs need 4,225, so up() raises the limits (never lowers them).
_NEIGH_LIMITS = {"gc_thresh2": 8192, "gc_thresh3": 16384}
_NEIGH_SYSCTL = Path("/proc/sys/net/ipv4/neigh/default")


class ClusterError(RuntimeError):
    """Building, changing or tearing down a namespace cluster failed."""


class ClusterUnavailable(ClusterError):
    """This machine cannot host a namespace cluster (not root, no netns, no sshd, ...)."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One namespace host: its unique hostname, its address on the bridge, its namespace."""

    name: str
    addr: str
    netns: str


# ---------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------

def _run(argv: Sequence[str], *, timeout: float = _CMD_TIMEOUT, check: bool = True,
         input: str | None = None) -> subprocess.CompletedProcess:
    """Run a command with captured text output and a timeout; raise ClusterError on failure."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              input=input, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"{shlex.join(argv)} timed out after {timeout:g} s") from exc
    except OSError as exc:
        raise ClusterError(f"{shlex.join(argv)}: {exc}") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise ClusterError(f"{shlex.join(argv)} exited {proc.returncode}: {detail}")
    return proc


def _ip_batch(commands: Sequence[str], *, netns: str | None = None, force: bool = False) -> None:
    """Run many ``ip`` commands in one process (``ip -batch``), optionally inside a namespace."""
    if not commands:
        return
    argv = ["ip"] + (["-n", netns] if netns else []) + (["-force"] if force else []) + ["-batch", "-"]
    _run(argv, input="\n".join(commands) + "\n", check=not force)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialise subnet allocation and /etc/hosts edits between concurrent processes."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _netns_list() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    proc = _run(["ip", "-j", "link", "show"], check=False)
    try:
        return [link["ifname"] for link in json.loads(proc.stdout or "[]")]
    except (ValueError, KeyError):
        return []


def _pid_alive(pid: int) -> bool:
    """True for a running process; zombies (already dead, not yet reaped) count as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _kill_and_wait(pids: Sequence[int], sig: int = signal.SIGKILL, wait: float = 2.0) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    deadline = time.monotonic() + wait
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _pids_with_cmdline(fragment: str) -> list[int]:
    """sshd daemons and ssh clients whose command line contains ``fragment`` (a workdir).

    Only the cluster's own plumbing: other tools that merely name the cluster's files
    (a launcher given its ssh_config, say) belong to whoever started them.
    """
    needle = fragment.encode()
    spared = _ancestors()  # never this process or whatever started it
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        argv0 = cmdline.split(b"\0", 1)[0]
        plumbing = argv0.startswith(b"sshd:") or os.path.basename(argv0) in (b"sshd", b"ssh")
        if plumbing and needle in cmdline:
            found.append(int(entry.name))
    return found


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _netns_pids(netns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", netns], check=False)
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def _hosts_lines(marker: str) -> list[str]:
    try:
        return [line for line in HOSTS_FILE.read_text().splitlines() if marker in line]
    except OSError:
        return []


def _edit_hosts(remove_marker: str, add: Sequence[str] = ()) -> None:
    """Drop every /etc/hosts line containing ``remove_marker``, then append ``add``.

    Rewritten in place (not renamed over), since /etc/hosts is often a bind mount.
    """
    with _locked():
        text = HOSTS_FILE.read_text()
        kept = [line for line in text.splitlines() if remove_marker not in line]
        new = "\n".join(kept + list(add)) + "\n"
        if new != text:
            with open(HOSTS_FILE, "r+") as fh:
                fh.write(new)
                fh.truncate()


def _iptables_rules(marker: str) -> list[list[str]]:
    """Root-namespace iptables rules (as ``-A CHAIN ...`` argv) carrying ``marker``."""
    if not shutil.which("iptables"):
        return []
    rules = []
    for chain in ("INPUT", "FORWARD"):
        proc = _run(["iptables", "-w", "5", "-S", chain], check=False)
        for line in proc.stdout.splitlines():
            if marker in line and line.startswith("-A "):
                rules.append(shlex.split(line))
    return rules


def _delete_iptables_rules(marker: str) -> None:
    for rule in _iptables_rules(marker):
        _run(["iptables", "-w", "5", "-D"] + rule[1:], check=False)


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for cmd in (["ip", "-j", "-4", "route", "show", "table", "all"], ["ip", "-j", "-4", "addr"]):
        proc = _run(cmd, check=False)
        try:
            data = json.loads(proc.stdout or "[]")
        except ValueError:
            continue
        for item in data:
            candidates = [item.get("dst", "")]
            for addr in item.get("addr_info", []):
                candidates.append(f"{addr.get('local')}/{addr.get('prefixlen')}")
            for dst in candidates:
                if not dst or dst == "default" or not dst[0].isdigit():
                    continue
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(dst, strict=False))
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{random.randint(64, 254)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used if u.version == 4):
            return net
    raise ClusterError("no free 10.x.y.0/24 subnet found (checked ip route and ip addr)")


def _raise_neigh_limits() -> None:
    """Make room in the kernel's (machine-wide) ARP table for many hosts talking all pairs."""
    for name, want in _NEIGH_LIMITS.items():
        path = _NEIGH_SYSCTL / name
        with contextlib.suppress(OSError, ValueError):
            if int(path.read_text()) < want:
                path.write_text(f"{want}\n")


@functools.lru_cache(maxsize=1)
def cluster_unavailable_reason() -> str | None:
    """Why this machine cannot host a namespace cluster, or None if it can (cached)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (euid is %d)" % os.geteuid()
    for tool in ("ip", "unshare", "ssh", "ssh-keygen", "iptables", "sh", "hostname"):
        if not shutil.which(tool):
            return f"{tool!r} not found on PATH"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} missing (apt-get install openssh-server)"
    probe = f"{NETNS_PREFIX}probe-{os.getpid()}-{secrets.token_hex(2)}"
    try:
        _run(["ip", "netns", "add", probe], timeout=5)
    except ClusterError as exc:
        return f"`ip netns add` failed: {exc}"
    try:
        _run(["ip", "netns", "exec", probe, "unshare", "--uts", "hostname", "dtrun-probe"], timeout=5)
        _run(["ip", "-n", probe, "link", "add", "dtprobe0", "type", "bridge"], timeout=5)
        _run(["ip", "netns", "exec", probe, "iptables", "-w", "5", "-A", "INPUT", "-p", "tcp",
              "--dport", "22", "-j", "DROP"], timeout=5)
    except ClusterError as exc:
        return f"namespace host setup failed: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False, timeout=5)
    return None


# ---------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------

_LIVE: dict[str, "Cluster"] = {}  # clusters up in this process, torn down at exit
CREATED_PREFIXES: list[str] = []  # every prefix this process brought up (leftover checks)


def _down_live_clusters() -> None:
    for cluster in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            cluster.down()


atexit.register(_down_live_clusters)


class Cluster:
    """N namespace hosts on one bridge, each with its own hostname and sshd.

    Args:
        n: number of hosts (1..99), named ``<prefix>-h1`` .. ``<prefix>-h<n>``.
        faults: host -> set of fault names (see ``HOST_FAULTS``). A host is given as a
            0-based index into ``hosts``, its full name, or its short name ``"h2"``.
        cluster_faults: faults applied to every host (``{"docker0"}``).
        prefix: name prefix (``[a-z][a-z0-9]{1,7}``); random ``dtXXXX`` by default.
        deny_ssh: (source, destination) host pairs: the client key is not authorised on
            the destination when the connection comes from the source (an inner host of
            Open MPI's tree spawn whose key its child does not accept). ssh from this
            machine and from every other host still works.

    Faults:
        docker0: a bridge ``docker0`` with 172.17.0.1/16, up, inside the host.
        firewall: INPUT accepts tcp/22 and ESTABLISHED,RELATED, drops all other TCP.
        dead: no sshd on the host; connecting to port 22 is refused at once.
        blackhole: INPUT drops tcp/22, so connecting times out.
        bad_path: non-interactive PATH is ``/usr/bin:/bin`` (no virtual environment).
        no_ld_library_path: LD_LIBRARY_PATH unset in the non-interactive environment.
        changed_hostkey: sshd serves a key other than the one in ``known_hosts``.
        unknown_hostkey: the host is missing from ``known_hosts``.
        other_mpi: bare ``mpirun``/``mpiexec`` resolve to Debian's Open MPI 4.1.4.
        slow_link: ``tc qdisc replace dev eth0 root tbf rate 50mbit burst 32kbit latency
            400ms``: everything the host sends leaves at 50 Mb/s (a slow NIC among fast ones).
    """

    def __init__(self, n: int, *, faults: Mapping[int | str, set[str]] | None = None,
                 cluster_faults: set[str] | frozenset[str] = frozenset(),
                 prefix: str | None = None,
                 deny_ssh: Sequence[tuple[int | str, int | str]] = ()) -> None:
        if not 1 <= n <= _MAX_HOSTS:
            raise ValueError(f"a cluster has 1..{_MAX_HOSTS} hosts, not {n}")
        if prefix is None:
            prefix = self._fresh_prefix()
        elif not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r} must match {_PREFIX_RE.pattern}")
        unknown = set(cluster_faults) - CLUSTER_FAULTS
        if unknown:
            raise ValueError(f"unknown cluster faults {sorted(unknown)}; known: {sorted(CLUSTER_FAULTS)}")
        self.prefix = prefix
        self.n = n
        self.workdir = STATE_DIR / prefix
        self.state_file = STATE_DIR / f"{prefix}.json"
        self.bridge = f"{BRIDGE_PREFIX}{prefix}"
        self.subnet = ""
        self.gateway = ""
        self.hosts: list[Host] = []
        self.origin = "library"
        self.cluster_faults = frozenset(cluster_faults)
        # Host names are known before up(); addresses once the subnet is chosen.
        self._names = [f"{prefix}-h{i}" for i in range(1, n + 1)]
        self._faults: dict[str, set[str]] = {name: set(cluster_faults) for name in self._names}
        for key, names in (faults or {}).items():
            name = self._resolve_name(key)
            bad = set(names) - HOST_FAULTS
            if bad:
                raise ValueError(f"{name}: unknown faults {sorted(bad)}; known: {sorted(HOST_FAULTS)}")
            self._faults[name] |= set(names)
        self._denied: set[tuple[str, str]] = set()
        for src, dst in deny_ssh:
            pair = (self._resolve_name(src), self._resolve_name(dst))
            if pair[0] == pair[1]:
                raise ValueError(f"deny_ssh {pair[0]} -> itself: name two different hosts")
            self._denied.add(pair)
        self._is_up = False

    # -- paths ---------------------------------------------------------------------------
    @property
    def client_key(self) -> Path:
        return self.workdir / "client_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.workdir / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        return self.workdir / "ssh_config"

    @property
    def hostfile(self) -> Path:
        """Open MPI style hostfile (``NAME slots=1`` per host)."""
        return self.workdir / "hostfile"

    @property
    def authorized_keys(self) -> Path:
        return self.workdir / "authorized_keys"

    def _authorized_keys_of(self, host: Host) -> Path:
        """The host's own authorized_keys: the client key, refused from denied sources."""
        return self.workdir / f"authorized_keys_{host.name}"

    def _host_key(self, host: Host, alt: bool = False) -> Path:
        return self.workdir / f"hostkey_{host.name}{'_changed' if alt else ''}"

    def _sshd_config(self, host: Host) -> Path:
        return self.workdir / f"sshd_{host.name}.conf"

    def _sshd_pidfile(self, host: Host) -> Path:
        return self.workdir / f"sshd_{host.name}.pid"

    # -- lookup --------------------------------------------------------------------------
    def _resolve_name(self, key: int | str | Host) -> str:
        if isinstance(key, Host):
            key = key.name
        if isinstance(key, int) and not isinstance(key, bool):
            if not -self.n <= key < self.n:
                raise KeyError(f"host index {key} out of range for {self.n} hosts")
            return self._names[key]
        if isinstance(key, str):
            if key in self._names:
                return key
            full = f"{self.prefix}-{key}"
            if full in self._names:
                return full
        raise KeyError(f"no host {key!r} in cluster {self.prefix} ({', '.join(self._names)})")

    def host(self, i_or_name: int | str | Host) -> Host:
        """A host by 0-based index, full name, or short name (``"h2"``)."""
        if not self.hosts:
            raise ClusterError(f"cluster {self.prefix} is not up")
        return self.hosts[self._names.index(self._resolve_name(i_or_name))]

    def faults_of(self, host: int | str | Host) -> frozenset[str]:
        return frozenset(self._faults[self._resolve_name(host)])

    @property
    def faults(self) -> dict[str, frozenset[str]]:
        return {name: frozenset(f) for name, f in self._faults.items()}

    @property
    def denied_ssh(self) -> frozenset[tuple[str, str]]:
        """(source, destination) host-name pairs whose host-to-host ssh is refused."""
        return frozenset(self._denied)

    def deny_ssh(self, src: int | str | Host, dst: int | str | Host, deny: bool = True) -> None:
        """Refuse (or, with deny=False, allow again) ssh from ``src`` into ``dst`` (running or not)."""
        pair = (self._resolve_name(src), self._resolve_name(dst))
        if pair[0] == pair[1]:
            raise ValueError(f"deny_ssh {pair[0]} -> itself: name two different hosts")
        (self._denied.add if deny else self._denied.discard)(pair)
        if self._is_up:
            self._write_authorized_keys()  # sshd reads the file at each login: no restart
            self._write_state()

    def __repr__(self) -> str:
        return f"Cluster({self.n}, prefix={self.prefix!r}, subnet={self.subnet!r}, up={self._is_up})"

    # -- lifecycle -----------------------------------------------------------------------
    @staticmethod
    def _fresh_prefix() -> str:
        existing = set(_netns_list())
        for _ in range(100):
            prefix = "dt" + secrets.token_hex(2)
            if not (STATE_DIR / prefix).exists() and f"{NETNS_PREFIX}{prefix}-h1" not in existing:
                return prefix
        raise ClusterError("could not find an unused cluster prefix")

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc_info) -> None:
        self.down()

    def up(self) -> "Cluster":
        """Create the hosts and start their sshd; on any failure tear everything down and raise."""
        if self._is_up:
            return self
        reason = cluster_unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        # Claim the prefix atomically (mkdir) before making anything: a failed up() tears
        # down by name and must never hit someone else's cluster.
        in_use = f"{NETNS_PREFIX}{self._names[0]}" in _netns_list()
        try:
            if not in_use:
                self.workdir.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            in_use = True
        if in_use:
            raise ClusterError(f"prefix {self.prefix!r} is in use ({self.workdir} or its namespaces exist)")
        _LIVE[self.prefix] = self
        CREATED_PREFIXES.append(self.prefix)
        try:
            self._up()
        except BaseException:
            # Also on KeyboardInterrupt / SystemExit from a SIGTERM handler.
            self.down()
            raise
        self._is_up = True
        return self

    def _up(self) -> None:
        keygens = self._start_keygens()
        with _locked():
            net = _pick_subnet()
            self.subnet = str(net)
            addrs = list(net.hosts())
            self.gateway = str(addrs[0])
            self.hosts = [Host(name, str(addrs[10 + i]), f"{NETNS_PREFIX}{name}")
                          for i, name in enumerate(self._names)]
            self._write_state()  # before creating anything, so a crash leaves a trail
            _ip_batch([f"link add {self.bridge} type bridge",
                       f"addr add {self.gateway}/{net.prefixlen} dev {self.bridge}",
                       f"link set {self.bridge} up"])
        self._create_hosts(net.prefixlen)
        _edit_hosts(self._hosts_marker,
                    [f"{h.addr}\t{h.name}\t# {self._hosts_marker}" for h in self.hosts])
        self._open_root_firewall()
        self._finish_keygens(keygens)
        self._write_ssh_files()
        _raise_neigh_limits()
        starting = [h for h in self.hosts if "dead" not in self._faults[h.name]]
        self._start_sshds(starting)
        self._wait_sshd(starting)
        for host in self.hosts:
            if self._faults[host.name] & _NETNS_FAULTS:  # a new host has none of them
                self._apply_netns_faults(host)

    def down(self) -> None:
        """Remove everything up() made. Safe to call at any point, and more than once."""
        _LIVE.pop(self.prefix, None)
        self._is_up = False
        errors = _teardown(prefix=self.prefix, workdir=self.workdir, bridge=self.bridge,
                           netns=[f"{NETNS_PREFIX}{name}" for name in self._names],
                           veths=[self._veth(i) for i in range(1, self.n + 1)])
        if errors:
            raise ClusterError(f"teardown of cluster {self.prefix} left: {'; '.join(errors)}")

    def detach(self) -> None:
        """Keep this cluster after the interpreter exits (the CLI's ``up``)."""
        _LIVE.pop(self.prefix, None)
        self.origin = "cli"
        self._write_state()

    @classmethod
    def from_state(cls, path: Path | str) -> "Cluster":
        """Rebuild a handle on a cluster made by another process (for ``down``/``status``)."""
        data = json.loads(Path(path).read_text())
        cluster = cls(data["n"], prefix=data["prefix"])
        cluster.subnet = data.get("subnet", "")
        cluster.gateway = data.get("gateway", "")
        cluster.origin = data.get("origin", "library")
        cluster.cluster_faults = frozenset(data.get("cluster_faults", []))
        cluster.hosts = [Host(**h) for h in data.get("hosts", [])]
        cluster._faults = {k: set(v) for k, v in data.get("faults", {}).items()} or cluster._faults
        cluster._denied = {tuple(p) for p in data.get("denied_ssh", [])}
        cluster._is_up = bool(cluster.hosts)
        return cluster

    def state(self) -> dict:
        return {
            "prefix": self.prefix, "n": self.n, "subnet": self.subnet, "gateway": self.gateway,
            "bridge": self.bridge, "workdir": str(self.workdir), "ssh_config": str(self.ssh_config),
            "hostfile": str(self.hostfile), "origin": self.origin, "pid": os.getpid(),
            "hosts": [dataclasses.asdict(h) for h in self.hosts],
            "faults": {k: sorted(v) for k, v in self._faults.items()},
            "cluster_faults": sorted(self.cluster_faults),
            "denied_ssh": sorted(self._denied),
        }

    def _write_state(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state(), indent=2) + "\n")
        tmp.replace(self.state_file)

    # -- building blocks -----------------------------------------------------------------
    @property
    def _hosts_marker(self) -> str:
        return f"{MARKER}:{self.prefix}"

    def _veth(self, i: int) -> str:
        return f"{VETH_PREFIX}{self.prefix}-{i}"

    def _create_hosts(self, prefixlen: int) -> None:
        root_cmds = []
        for i, host in enumerate(self.hosts, start=1):
            root_cmds += [f"netns add {host.netns}",
                          f"link add {self._veth(i)} type veth peer name eth0 netns {host.netns}",
                          f"link set {self._veth(i)} master {self.bridge}",
                          f"link set {self._veth(i)} up"]
        _ip_batch(root_cmds)
        for host in self.hosts:
            _ip_batch(["link set lo up",
                       f"addr add {host.addr}/{prefixlen} dev eth0",
                       "link set eth0 up",
                       f"route add default via {self.gateway}"], netns=host.netns)

    def _open_root_firewall(self) -> None:
        """Let bridge traffic through the root namespace's iptables.

        With br_netfilter loaded (``net.bridge.bridge-nf-call-iptables=1``) bridged frames
        traverse the root FORWARD chain, where Docker's rules or a DROP policy would eat
        host-to-host traffic; hosts also connect back to the launcher (root INPUT).
        """
        comment = ["-m", "comment", "--comment", self._hosts_marker]
        for rule in (["INPUT", "1", "-i", self.bridge],
                     ["FORWARD", "1", "-i", self.bridge, "-o", self.bridge]):
            _run(["iptables", "-w", "5", "-I"] + rule + comment + ["-j", "ACCEPT"])

    def _start_keygens(self) -> list[subprocess.Popen]:
        keys = [self.client_key] + [self.workdir / f"hostkey_{name}" for name in self._names]
        return [self._keygen(key) for key in keys]

    def _keygen(self, key: Path) -> subprocess.Popen:
        return subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", key.name,
                                 "-f", str(key)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def _finish_keygens(procs: list[subprocess.Popen]) -> None:
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=_CMD_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise ClusterError(f"ssh-keygen timed out: {shlex.join(proc.args)}")
            if proc.returncode != 0:
                raise ClusterError(f"{shlex.join(proc.args)} failed: {err.strip()}")

    def _write_ssh_files(self) -> None:
        self.authorized_keys.write_text(Path(f"{self.client_key}.pub").read_text())
        self._write_authorized_keys()
        blocks = []
        for host in self.hosts:
            blocks.append(
                f"Host {host.name}\n"
                f"    HostName {host.addr}\n"
                f"    User root\n"
                f"    Port 22\n"
                f"    IdentityFile {self.client_key}\n"
                f"    IdentitiesOnly yes\n"
                f"    UserKnownHostsFile {self.known_hosts}\n"
                f"    GlobalKnownHostsFile /dev/null\n"
                f"    StrictHostKeyChecking yes\n"
                f"    UpdateHostKeys no\n"
                f"    BatchMode yes\n"
                f"    ConnectTimeout 5\n")
        self.ssh_config.write_text(f"# namespace cluster {self.prefix}, made by tests/nscluster.py\n\n"
                                   + "\n".join(blocks))
        self.hostfile.write_text("".join(f"{h.name} slots=1\n" for h in self.hosts))
        self._write_known_hosts()

    def _write_authorized_keys(self) -> None:
        """One authorized_keys per host; ``from="!ADDR,*"`` refuses the key from denied sources."""
        key = self.authorized_keys.read_text().strip()
        for host in self.hosts:
            refused = sorted(self.host(src).addr for src, dst in self._denied if dst == host.name)
            opts = ('from="' + ",".join(f"!{a}" for a in refused) + ',*" ') if refused else ""
            path = self._authorized_keys_of(host)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(f"{opts}{key}\n")
            tmp.replace(path)

    def _write_known_hosts(self) -> None:
        lines = []
        for host in self.hosts:
            if "unknown_hostkey" in self._faults[host.name]:
                continue
            pub = Path(f"{self._host_key(host)}.pub").read_text().split()
            lines.append(f"{host.name},{host.addr} {pub[0]} {pub[1]}\n")
        self.known_hosts.write_text("".join(lines))

    def _host_env(self, host: Host) -> dict[str, str]:
        """The non-interactive environment sshd gives sessions on ``host`` (see module doc)."""
        faults = self._faults[host.name]
        path = BAD_PATH if "bad_path" in faults else HEALTHY_PATH
        if "other_mpi" in faults:
            path = f"{self._other_mpi_bin()}:{path}"
        env = {"PATH": path, "SHLVL": "1"}
        if "no_ld_library_path" not in faults:
            env["LD_LIBRARY_PATH"] = HEALTHY_LD_LIBRARY_PATH
        return env

    def _other_mpi_bin(self) -> Path:
        bindir = self.workdir / "other-mpi" / "bin"
        if not bindir.is_dir():
            bindir.mkdir(parents=True)
            for name, target in OTHER_MPI_LINKS.items():
                (bindir / name).symlink_to(target)
        return bindir

    def _write_sshd_config(self, host: Host) -> Path:
        faults = self._faults[host.name]
        key = self._host_key(host, alt="changed_hostkey" in faults)
        if not key.exists():
            self._finish_keygens([self._keygen(key)])
        q = lambda value: '"' + str(value) + '"'  # sshd_config tokens may contain spaces
        setenv = " ".join(q(f"{k}={v}") for k, v in self._host_env(host).items())
        conf = self._sshd_config(host)
        conf.write_text(
            f"# sshd for {host.name} in namespace {host.netns}\n"
            f"ListenAddress {host.addr}:22\n"
            f"HostKey {q(key)}\n"
            f"PidFile {q(self._sshd_pidfile(host))}\n"
            f"AuthorizedKeysFile {q(self._authorized_keys_of(host))}\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "UseDNS no\n"
            "PrintMotd no\n"
            "LogLevel ERROR\n"
            # fan-out checks and mpirun open many connections at once
            "MaxStartups 200\n"
            "MaxSessions 200\n"
            "Subsystem sftp /usr/lib/openssh/sftp-server\n"
            f"SetEnv {setenv}\n")
        return conf

    def _netns_argv(self, host: Host, argv: Sequence[str]) -> list[str]:
        """argv run inside the host's namespace under its own hostname (no shell parsing of argv)."""
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", host.name, *argv]

    def _start_sshd(self, host: Host, *, wait: bool = True) -> None:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation dir
        self._sshd_pidfile(host).unlink(missing_ok=True)
        conf = self._write_sshd_config(host)
        log = self.workdir / f"sshd_{host.name}.log"
        # sshd daemonises (stdio -> /dev/null) after binding, then writes its PidFile.
        _run(self._netns_argv(host, [SSHD, "-f", str(conf), "-E", str(log)]))
        if wait:
            self._wait_sshd([host])

    def _start_sshds(self, hosts: Sequence[Host]) -> None:
        """Start the hosts' sshd all at once (each daemonises after binding); bounded wait."""
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        procs = []
        for host in hosts:
            self._sshd_pidfile(host).unlink(missing_ok=True)
            conf = self._write_sshd_config(host)
            log = self.workdir / f"sshd_{host.name}.log"
            argv = self._netns_argv(host, [SSHD, "-f", str(conf), "-E", str(log)])
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + _CMD_TIMEOUT
        failed = []
        for host, proc in zip(hosts, procs):
            try:
                _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                failed.append(f"{host.name}: sshd did not start within {_CMD_TIMEOUT:g} s")
                continue
            if proc.returncode != 0:
                failed.append(f"{host.name}: sshd exited {proc.returncode}: {err.strip()}")
        if failed:
            raise ClusterError("; ".join(failed))

    def _stop_sshd(self, host: Host) -> None:
        pidfile = self._sshd_pidfile(host)
        with contextlib.suppress(OSError, ValueError):
            _kill_and_wait([int(pidfile.read_text().split()[0])], signal.SIGTERM)
        pidfile.unlink(missing_ok=True)

    def _wait_sshd(self, hosts: Sequence[Host]) -> None:
        """Wait until each host's sshd answers with an SSH banner (bounded)."""
        deadline = time.monotonic() + _SSHD_READY_TIMEOUT
        pending = list(hosts)
        while pending:
            pending = [h for h in pending if not self._sshd_ready(h)]
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(h.name for h in pending)
                logs = "; ".join(f"{h.name}: {self._sshd_log_tail(h)}" for h in pending)
                raise ClusterError(f"sshd not ready after {_SSHD_READY_TIMEOUT:g} s on {names} ({logs})")
            time.sleep(0.02)

    def _sshd_ready(self, host: Host) -> bool:
        try:
            pid = int(self._sshd_pidfile(host).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        if not _pid_alive(pid):
            return False
        if "blackhole" in self._faults[host.name]:
            # Port 22 is dropped; look at the listening socket from inside instead.
            return _listening(pid, host.addr, 22)
        try:
            with socket.create_connection((host.addr, 22), timeout=0.5) as sock:
                sock.settimeout(1.0)
                return sock.recv(4).startswith(b"SSH-")
        except OSError:
            return False

    def _sshd_log_tail(self, host: Host) -> str:
        try:
            text = (self.workdir / f"sshd_{host.name}.log").read_text().strip()
        except OSError:
            return "no log"
        return text.splitlines()[-1] if text else "empty log"

    # -- faults --------------------------------------------------------------------------
    def _apply_netns_faults(self, host: Host) -> None:
        """Bring docker0 and the host's iptables INPUT chain in line with its faults."""
        faults = self._faults[host.name]
        has_docker0 = any(line.split(":")[1].strip().split("@")[0] == "docker0"
                          for line in _run(["ip", "-n", host.netns, "-o", "link", "show"]).stdout.splitlines())
        if "docker0" in faults and not has_docker0:
            # What Docker's daemon leaves on a node: a bridge with 172.17.0.1/16, up, no ports.
            _ip_batch(["link add docker0 type bridge",
                       "addr add 172.17.0.1/16 dev docker0",
                       "link set docker0 up"], netns=host.netns)
        elif "docker0" not in faults and has_docker0:
            _ip_batch(["link del docker0"], netns=host.netns)
        self._apply_iptables(host)
        self._apply_tc(host)

    def _apply_tc(self, host: Host) -> None:
        tc = ["ip", "netns", "exec", host.netns, "tc", "qdisc"]
        if "slow_link" in self._faults[host.name]:
            _run(tc + ["replace", "dev", "eth0", "root", *SLOW_LINK_TBF])
        elif "tbf" in _run(tc + ["show", "dev", "eth0"], check=False).stdout:
            _run(tc + ["del", "dev", "eth0", "root"], check=False)

    def _apply_iptables(self, host: Host) -> None:
        faults = self._faults[host.name]
        wanted: list[list[str]] = []
        if "blackhole" in faults:
            wanted.append(["-p", "tcp", "--dport", "22", "-j", "DROP"])
        if "firewall" in faults:
            wanted += [["-p", "tcp", "--dport", "22", "-j", "ACCEPT"],
                       ["-p", "tcp", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                       ["-p", "tcp", "-j", "DROP"]]
        ipt = ["ip", "netns", "exec", host.netns, "iptables", "-w", "5"]
        current = _run(ipt + ["-S", "INPUT"], check=False).stdout if shutil.which("iptables") else ""
        if not wanted and "-A INPUT" not in current:
            return
        _run(ipt + ["-F", "INPUT"])
        for rule in wanted:
            _run(ipt + ["-A", "INPUT"] + rule)

    def add_fault(self, host: int | str | Host, fault: str) -> None:
        """Apply a fault to a running cluster (also fine before up())."""
        self._change_fault(host, fault, add=True)

    def remove_fault(self, host: int | str | Host, fault: str) -> None:
        """Undo a fault on a running cluster; the host behaves as healthy again for it."""
        self._change_fault(host, fault, add=False)

    def _change_fault(self, key: int | str | Host, fault: str, *, add: bool) -> None:
        if fault not in HOST_FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {sorted(HOST_FAULTS)}")
        name = self._resolve_name(key)
        if (fault in self._faults[name]) == add:
            return
        (self._faults[name].add if add else self._faults[name].discard)(fault)
        if not self._is_up:
            return
        host = self.host(name)
        if fault in _NETNS_FAULTS:
            self._apply_netns_faults(host)
        elif fault == "unknown_hostkey":
            self._write_known_hosts()
        elif fault == "dead":
            self._stop_sshd(host) if add else self._start_sshd(host)
        elif fault in _SSHD_FAULTS and "dead" not in self._faults[name]:
            self._stop_sshd(host)
            self._start_sshd(host)
        self._write_state()

    # -- running things on hosts ---------------------------------------------------------
    def exec(self, host: int | str | Host, argv: Sequence[str], *, timeout: float = 30,
             check: bool = False, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run argv inside the host's namespace under its hostname; text output captured.

        ``env`` entries are added to (and override) this process's environment.
        Raises subprocess.TimeoutExpired / CalledProcessError like subprocess.run.
        """
        h = self.host(host)
        full_env = {**os.environ, **env} if env is not None else None
        proc = subprocess.run(self._netns_argv(h, argv), capture_output=True, text=True,
                              timeout=timeout, env=full_env, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, list(argv), proc.stdout, proc.stderr)
        return proc

    def popen(self, host: int | str | Host, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start argv in the background inside the host's namespace under its hostname.

        The Popen's pid is argv's own process (``ip netns exec``, ``unshare`` and ``sh``
        all exec). down() kills anything still running in the namespace.
        """
        h = self.host(host)
        return subprocess.Popen(self._netns_argv(h, argv), **popen_kwargs)

    def ssh_argv(self, host: int | str | Host) -> list[str]:
        return ["ssh", "-F", str(self.ssh_config), self.host(host).name]


def _listening(pid: int, addr: str, port: int) -> bool:
    """Whether the network namespace of ``pid`` has a TCP socket listening on addr:port."""
    want = f"{socket.htonl(int(ipaddress.IPv4Address(addr))):08X}:{port:04X}"
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(parts[1] in (want, f"00000000:{port:04X}") and parts[3] == "0A"
               for parts in (line.split() for line in lines))


# ---------------------------------------------------------------------------------------
# Teardown and leftovers (work from names alone, so any process can clean up)
# ---------------------------------------------------------------------------------------

def _teardown(*, prefix: str | None, workdir: Path | None, bridge: str | None,
              netns: Sequence[str], veths: Sequence[str]) -> list[str]:
    """Remove a cluster's pieces; return what is still there afterwards."""
    existing_ns = set(_netns_list())
    doomed = [ns for ns in netns if ns in existing_ns]
    pids = [pid for ns in doomed for pid in _netns_pids(ns)]
    if workdir is not None:
        pids += _pids_with_cmdline(f"{workdir}/")
    _kill_and_wait(sorted(set(pids)))
    links = set(_link_names())
    _ip_batch([f"link del {v}" for v in veths if v in links]
              + ([f"link del {bridge}"] if bridge and bridge in links else [])
              + [f"netns del {ns}" for ns in doomed], force=True)
    marker = f"{MARKER}:{prefix}" if prefix else f"{MARKER}:"
    if _hosts_lines(marker):
        _edit_hosts(marker)
    _delete_iptables_rules(marker)
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
        if prefix:
            (STATE_DIR / f"{prefix}.json").unlink(missing_ok=True)
    return leftovers(prefix)


def leftovers(prefix: str | None = None) -> list[str]:
    """What a cluster (or, with no prefix, any dtrun test cluster) left on this machine."""
    found = []
    ns_start = f"{NETNS_PREFIX}{prefix}-" if prefix else NETNS_PREFIX
    found += [f"netns {ns}" for ns in _netns_list() if ns.startswith(ns_start)]
    link_starts = ((f"{BRIDGE_PREFIX}{prefix}", f"{VETH_PREFIX}{prefix}-") if prefix
                   else (BRIDGE_PREFIX, VETH_PREFIX))
    found += [f"link {name}" for name in _link_names()
              if name == link_starts[0] or name.startswith(link_starts[1])
              or (not prefix and name.startswith(link_starts[0]))]
    marker = f"{MARKER}:{prefix}" if prefix else f"{MARKER}:"
    found += [f"/etc/hosts line {line!r}" for line in _hosts_lines(marker)]
    found += [f"iptables rule {shlex.join(rule)}" for rule in _iptables_rules(marker)]
    where = f"{STATE_DIR / prefix}/" if prefix else f"{STATE_DIR}/"
    found += [f"process {pid} ({_cmdline(pid)})" for pid in _pids_with_cmdline(where)]
    if prefix and (STATE_DIR / prefix).exists():
        found.append(f"workdir {STATE_DIR / prefix}")
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def down_prefix(prefix: str) -> list[str]:
    """Remove one cluster's pieces found by name alone (no state file needed); return leftovers."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix {prefix!r} must match {_PREFIX_RE.pattern}")
    netns = [ns for ns in _netns_list() if ns.startswith(f"{NETNS_PREFIX}{prefix}-")]
    veths = [name for name in _link_names() if name.startswith(f"{VETH_PREFIX}{prefix}-")]
    return _teardown(prefix=prefix, workdir=STATE_DIR / prefix, bridge=f"{BRIDGE_PREFIX}{prefix}",
                     netns=netns, veths=veths)


def down_all() -> list[str]:
    """Remove every dtrun test cluster on this machine (any process's); return leftovers."""
    netns = [ns for ns in _netns_list() if ns.startswith(NETNS_PREFIX)]
    links = [name for name in _link_names() if name.startswith((BRIDGE_PREFIX, VETH_PREFIX))]
    _teardown(prefix=None, workdir=None, bridge=None, netns=netns,
              veths=[name for name in links])
    _kill_and_wait(_pids_with_cmdline(f"{STATE_DIR}/"))
    if STATE_DIR.is_dir():
        for entry in STATE_DIR.iterdir():
            if entry.name == ".lock":
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    return leftovers()


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------

def _state_files() -> list[Path]:
    return sorted(STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []


def _parse_fault_specs(specs: Sequence[str]) -> dict[str, set[str]]:
    """``["h2=firewall,dead", "h3=bad_path"]`` -> ``{"h2": {...}, "h3": {...}}``."""
    faults: dict[str, set[str]] = {}
    for spec in specs:
        host, sep, names = spec.partition("=")
        if not sep or not host or not names:
            raise ValueError(f"--fault {spec!r}: expected HOST=FAULT[,FAULT...], e.g. h2=firewall")
        key: int | str = int(host) if host.isdigit() else host
        faults.setdefault(key, set()).update(n.strip() for n in names.split(",") if n.strip())
    return faults


def _parse_pair(spec: str) -> tuple[int | str, int | str]:
    """``"h1:h65"`` -> ``("h1", "h65")`` (a host is h1.., a full name, or a 0-based index)."""
    src, sep, dst = spec.partition(":")
    if not sep or not src or not dst:
        raise ValueError(f"--deny-ssh {spec!r}: expected SRC:DST, e.g. h1:h65")
    return tuple(int(h) if h.isdigit() else h for h in (src, dst))


def _print_cluster(cluster: Cluster) -> None:
    print(f"cluster {cluster.prefix}: {cluster.n} hosts on {cluster.subnet} "
          f"(bridge {cluster.bridge}, gateway {cluster.gateway})")
    for host in cluster.hosts:
        faults = ",".join(sorted(cluster.faults_of(host))) or "healthy"
        denied = sorted(src for src, dst in cluster.denied_ssh if dst == host.name)
        if denied:
            faults += f"; refuses ssh from {', '.join(denied)}"
        print(f"  {host.name:<14} {host.addr:<15} {faults}")
    print(f"ssh config: {cluster.ssh_config}")
    print(f"hostfile:   {cluster.hostfile}")
    print(f"state:      {cluster.state_file}")
    print(f"try:        {shlex.join(cluster.ssh_argv(cluster.hosts[0]) + ['hostname'])}")


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.nscluster",
                                     description="Network-namespace test clusters for dtrun.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="create a cluster of N hosts and leave it running")
    p_up.add_argument("n", type=int)
    p_up.add_argument("--fault", "--faults", action="append", default=[], metavar="HOST=FAULT[,FAULT]",
                      help=f"per-host faults; HOST is h1.., a full name, or a 0-based index; "
                           f"FAULT one of {', '.join(sorted(HOST_FAULTS))}")
    p_up.add_argument("--cluster-fault", "--cluster-faults", action="append", default=[],
                      metavar="FAULT", help="fault for every host (docker0)")
    p_up.add_argument("--deny-ssh", action="append", default=[], metavar="SRC:DST",
                      help="refuse ssh from host SRC into host DST (the client key is not authorised there "
                           "from SRC), e.g. h1:h65")
    p_up.add_argument("--prefix", help="name prefix (default: random dtXXXX)")
    p_up.add_argument("--hold", action="store_true",
                      help="stay in the foreground; tear down on Ctrl-C / SIGTERM")
    p_up.add_argument("--json", action="store_true", help="print the state as JSON")
    p_down = sub.add_parser(
        "down", help="tear down clusters made by `up`: with no PREFIX every one on this machine, "
                     "whoever ran it (scripts sharing the machine should pass PREFIX)")
    p_down.add_argument("prefix", nargs="?", help="only this cluster (any origin)")
    p_down.add_argument("--all", action="store_true",
                        help="every dtrun test cluster and leftover on this machine, whoever made it")
    sub.add_parser("status", help="list known clusters and leftovers")
    args = parser.parse_args(argv)

    if args.command == "up":
        signal.signal(signal.SIGTERM, _raise_on_sigterm)
        try:
            faults = _parse_fault_specs(args.fault)
            cluster_faults = {f.strip() for spec in args.cluster_fault for f in spec.split(",") if f.strip()}
            deny = [_parse_pair(spec) for spec in args.deny_ssh]
            cluster = Cluster(args.n, faults=faults, cluster_faults=cluster_faults, prefix=args.prefix,
                              deny_ssh=deny)
        except (ValueError, KeyError) as exc:
            parser.error(str(exc.args[0]) if exc.args else str(exc))
        try:
            cluster.up()
        except ClusterError as exc:
            print(f"nscluster: {exc}", file=sys.stderr)
            return 1
        if args.hold:
            cluster.origin = "cli"
            cluster._write_state()
            _print_cluster(cluster)
            print("holding; Ctrl-C or SIGTERM tears it down", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except (KeyboardInterrupt, SystemExit):
                pass
            finally:
                cluster.down()
            return 0
        cluster.detach()  # outlive this process; `down` finds it through the state file
        if args.json:
            print(json.dumps(cluster.state(), indent=2))
        else:
            _print_cluster(cluster)
        return 0

    if args.command == "down":
        if args.prefix and not _PREFIX_RE.match(args.prefix):
            parser.error(f"prefix {args.prefix!r} must match {_PREFIX_RE.pattern}")
        if args.all:
            left = down_all()
        else:
            left = []
            targets = ([STATE_DIR / f"{args.prefix}.json"] if args.prefix else
                       [p for p in _state_files() if _origin(p) == "cli"])
            if args.prefix and not targets[0].exists():
                # No state (crashed `up`?): remove whatever carries the name.
                left = down_prefix(args.prefix)
                print(f"cluster {args.prefix}: no state file; removed leftovers by name")
                targets = []
            for path in targets:
                cluster = Cluster.from_state(path)
                try:
                    cluster.down()
                    print(f"cluster {cluster.prefix}: down")
                except ClusterError as exc:
                    left.append(str(exc))
        for item in left:
            print(f"nscluster: leftover: {item}", file=sys.stderr)
        return 1 if left else 0

    if args.command == "status":
        for path in _state_files():
            with contextlib.suppress(ValueError, KeyError, OSError):
                cluster = Cluster.from_state(path)
                alive = all(h.netns in _netns_list() for h in cluster.hosts) and bool(cluster.hosts)
                print(f"# {'up' if alive else 'BROKEN'} (origin {cluster.origin})")
                _print_cluster(cluster)
        stray = leftovers()
        known = {p.stem for p in _state_files()}
        stray = [s for s in stray if not any(k in s for k in known)]
        for item in stray:
            print(f"leftover: {item}")
        return 0
    return 2


def _origin(path: Path) -> str:
    try:
        return json.loads(path.read_text()).get("origin", "library")
    except (OSError, ValueError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
