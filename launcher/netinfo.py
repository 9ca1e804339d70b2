"""Which local network reaches every host of a job (no SSH, a few milliseconds).

Open MPI binds its TCP transport and its runtime wiring to interfaces; naming the
one subnet all hosts share (include) is more reliable than listing what to avoid
(exclude): on hosts that all carry docker0, Open MPI 5's runtime crashed
intermittently with an exclude list and never with the shared subnet included (see
docs/cluster-testing.md). Interface names can differ between hosts, so the subnet is
passed in CIDR form, which Open MPI's *_if_include accept.
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Optional, Sequence

from dtrun.launcher.interfaces import local_interfaces

RESOLVE_TIMEOUT_S = 2.0
DRY_RUN_RESOLVE_S = 0.3  # --dry-run shows the command without waiting on a slow DNS


@dataclass(frozen=True)
class InterfaceChoice:
    """The subnet a launch should use, and why: what the preflight found on the hosts.

    The preflight (``checks/preflight.py``) returns one; ``launch.make_spec`` applies it
    unless the user chose interfaces themselves.
    """

    include: Optional[str]  # CIDR for MPI's TCP transport and its runtime (None: no subnet shared by all)
    nccl: Optional[str]  # NCCL_SOCKET_IFNAME value
    reason: str  # where it came from, for --dry-run and --verbose
    host_ifaces: tuple = ()  # (host, ((iface, addr/prefix), ...)) as each remote host reported them


@dataclass(frozen=True)
class SharedSubnet:
    iface: str  # the launching host's interface on it
    cidr: str  # e.g. "10.0.0.0/24"


def _resolve(host: str) -> Optional[str]:
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    return infos[0][4][0] if infos else None


def resolve_all(hosts: Sequence[str], timeout: float = RESOLVE_TIMEOUT_S, workers: int = 64) -> dict[str, Optional[str]]:
    """IPv4 address of each host (None where it does not resolve within ``timeout`` in all).

    Daemon threads, so a DNS server that never answers delays neither the answer
    beyond ``timeout`` nor dtrun's exit; hosts not yet resolved count as unresolved.
    """
    import queue
    import threading

    results: dict[str, Optional[str]] = {}
    todo: "queue.SimpleQueue[str]" = queue.SimpleQueue()
    for h in dict.fromkeys(hosts):
        todo.put(h)
    done = threading.Event()
    lock = threading.Lock()
    wanted = len(set(hosts))

    def work():
        while True:
            try:
                h = todo.get_nowait()
            except queue.Empty:
                return
            addr = _resolve(h)
            with lock:
                results[h] = addr
                if len(results) == wanted:
                    done.set()

    if wanted:
        for _ in range(min(workers, wanted)):
            threading.Thread(target=work, daemon=True).start()
        done.wait(timeout)
    with lock:
        return {h: results.get(h) for h in hosts}


def local_networks() -> list[tuple[str, ipaddress.IPv4Network]]:
    """(interface, network) for every IPv4 address of this machine that is up, except loopback.

    Read the way doctor and the preflight read interfaces (``ip -j addr``, else sysfs).
    """
    return [(i.name, n.network) for i in local_interfaces() if i.up and not i.loopback
            for n in i.networks if not n.ip.is_loopback]


def local_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of every interface of this machine that is up, except loopback."""
    return [(i.name, str(n.ip)) for i in local_interfaces() if i.up and not i.loopback for n in i.networks]


def local_address_on(cidr: str, addresses) -> Optional[str]:
    """This machine's IPv4 address inside ``cidr`` (pure: ``addresses`` from ``local_addresses``)."""
    try:
        net = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return None
    for _, addr in addresses:
        ip = ipaddress.ip_address(addr)
        if ip in net and not ip.is_loopback:
            return str(ip)
    return None


def shared_subnet(addresses: Sequence[str], networks=None) -> Optional[SharedSubnet]:
    """The local network that contains every address, or None (pure given ``networks``)."""
    if not addresses:
        return None
    networks = local_networks() if networks is None else networks
    ips = [ipaddress.ip_address(a) for a in addresses]
    for iface, net in networks:
        if iface != "docker0" and _all_in(ips, net):
            return SharedSubnet(iface, str(net))
    return None


def _all_in(ips, net) -> bool:
    return all(ip in net for ip in ips)


def infer_shared_subnet(remote_hosts: Sequence[str], timeout: float = RESOLVE_TIMEOUT_S) -> Optional[SharedSubnet]:
    """Resolve the remote hosts (within ``timeout`` in all) and find the local subnet shared by all of them."""
    resolved = resolve_all(remote_hosts, timeout)
    if any(a is None for a in resolved.values()):
        return None
    return shared_subnet(list(resolved.values()))
