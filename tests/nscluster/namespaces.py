"""The network side of the cluster: namespaces, the bridge, veth pairs, addresses, names.

Every host is a network namespace whose ``eth0`` is one end of a veth pair; the other end
sits on a bridge in the root namespace, which holds the gateway address. /etc/hosts maps
each host name to its address, and two root-namespace iptables rules let bridge traffic
through. Everything made here carries the cluster's prefix (or ``MARKER:<prefix>``) so it
can be found and removed by name alone.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import random
import secrets
import shlex
import shutil
import socket
import sys
from pathlib import Path
from typing import Sequence

from .common import (HOSTS_FILE, MARKER, NETNS_PREFIX, SSHD, VETH_PREFIX, ClusterError, Host, _ClusterBase,
                     _locked, _run)

# The kernel's ARP table is one table for every namespace: gc_thresh3 (default 1024) caps
# the entries of all hosts together, and past it new neighbours are refused ("neighbor
# table overflow"). N hosts that all talk to each other need about N*N entries: 65 hosts
# connecting all pairs need 4,225, so up() raises the limits (never lowers them).
_NEIGH_LIMITS = {"gc_thresh2": 8192, "gc_thresh3": 16384}
_NEIGH_SYSCTL = Path("/proc/sys/net/ipv4/neigh/default")


def _ip_batch(commands: Sequence[str], *, netns: str | None = None, force: bool = False) -> None:
    """Run many ``ip`` commands in one process (``ip -batch``), optionally inside a namespace."""
    if not commands:
        return
    argv = ["ip"] + (["-n", netns] if netns else []) + (["-force"] if force else []) + ["-batch", "-"]
    _run(argv, input="\n".join(commands) + "\n", check=not force)


def _netns_list() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    proc = _run(["ip", "-j", "link", "show"], check=False)
    try:
        return [link["ifname"] for link in json.loads(proc.stdout or "[]")]
    except (ValueError, KeyError):
        return []


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


def _listening(pid: int, addr: str, port: int) -> bool:
    """Whether the network namespace of ``pid`` has a TCP socket listening on addr:port."""
    want = f"{socket.htonl(int(ipaddress.IPv4Address(addr))):08X}:{port:04X}"
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(parts[1] in (want, f"00000000:{port:04X}") and parts[3] == "0A"
               for parts in (line.split() for line in lines))


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


class _Namespaces(_ClusterBase):
    """The Cluster's namespace plumbing: one namespace and veth pair per host, on its bridge."""

    @property
    def _hosts_marker(self) -> str:
        return f"{MARKER}:{self.prefix}"

    def _veth(self, i: int) -> str:
        return f"{VETH_PREFIX}{self.prefix}-{i}"

    def _create_bridge(self, net: ipaddress.IPv4Network) -> None:
        _ip_batch([f"link add {self.bridge} type bridge",
                   f"addr add {self.gateway}/{net.prefixlen} dev {self.bridge}",
                   f"link set {self.bridge} up"])

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

    def _netns_argv(self, host: Host, argv: Sequence[str]) -> list[str]:
        """argv run inside the host's namespace under its own hostname (no shell parsing of argv)."""
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", host.name, *argv]
