"""Network interfaces: the model launcher/ and checks/ share, and this machine's own.

``Interface`` is one interface with its IPv4 addresses; ``parse_ip_json`` reads
``ip -j addr`` output (this machine's, or a remote host's that the preflight or the
doctor's probe fetched). ``local_interfaces`` is the only I/O here: it runs ``ip``
(with a timeout) and falls back to psutil where iproute2 is missing.
"""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Optional

# Interfaces container and VM tools create; their addresses do not lead to other hosts.
VIRTUAL = re.compile(r"^(docker\d*|virbr\d*|veth.*|br-.*|cni\d*|flannel.*|cali.*|vxlan.*|lxcbr\d*|lxdbr\d*|podman\d*)$")
IP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Interface:
    name: str
    up: bool
    mtu: Optional[int]
    addrs: tuple[str, ...] = ()  # IPv4 "addr/prefixlen"

    @property
    def networks(self) -> list[ipaddress.IPv4Interface]:
        return [ipaddress.IPv4Interface(a) for a in self.addrs]

    @property
    def virtual(self) -> bool:
        return bool(VIRTUAL.match(self.name))

    @property
    def loopback(self) -> bool:
        return self.name == "lo" or all(n.ip.is_loopback for n in self.networks) and bool(self.addrs)


def parse_ip_json(text: str) -> list[Interface]:
    """``ip -j addr`` output → interfaces (IPv4 addresses only: MPI's TCP transports use those)."""
    out = []
    for item in json.loads(text or "[]"):
        flags = item.get("flags", [])
        state = item.get("operstate", "UNKNOWN")
        up = "UP" in flags and state != "DOWN" and ("LOWER_UP" in flags or state in ("UP", "UNKNOWN"))
        addrs = tuple(f"{a['local']}/{a['prefixlen']}" for a in item.get("addr_info", [])
                      if a.get("family") == "inet" and "local" in a)
        out.append(Interface(item.get("ifname", "?"), up, item.get("mtu"), addrs))
    return out


def local_interfaces() -> list[Interface]:
    """This machine's interfaces: ``ip -j addr``, or psutil's view where ``ip`` cannot run."""
    import subprocess

    try:
        out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                             stdin=subprocess.DEVNULL)
        if out.returncode == 0:
            return parse_ip_json(out.stdout)
    except (OSError, subprocess.TimeoutExpired):
        pass
    return _psutil_interfaces()


def _psutil_interfaces() -> list[Interface]:
    import socket

    import psutil

    stats = psutil.net_if_stats()
    out = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        st = stats.get(name)
        v4 = tuple(str(ipaddress.IPv4Interface(f"{a.address}/{a.netmask}")) for a in addrs
                   if a.family == socket.AF_INET and a.netmask)
        out.append(Interface(name, bool(st and st.isup), st.mtu if st else None, v4))
    return out
