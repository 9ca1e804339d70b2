"""Interfaces of every host, and which subnet MPI, its runtime and NCCL should use.

Pure: ``parse_ip_json`` / ``parse_sysfs`` turn what the probe found into
``Interface`` values (the interface model lives in ``launcher/interfaces.py``), and ``recommend`` finds the subnet that every host (and the
launching host, where mpirun runs) has an address on, that is not a virtual bridge
and whose addresses are all different — docker0 carries 172.17.0.1 on every host
and hangs Open MPI's TCP transport (docs/cluster-testing.md). Naming the subnet
to include is more reliable with Open MPI 5 than naming what to exclude.
"""
from __future__ import annotations

import ipaddress
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from dtrun.checks.probereport import ProbeReport, probe_report
from dtrun.checks.result import FAIL, OK, WARN, Finding
from dtrun.launcher import command as cmd
from dtrun.launcher.flavors import OPENMPI, Flavor
from dtrun.launcher.interfaces import VIRTUAL, Interface, local_interfaces, parse_ip_json

CHECK = "network"
__all__ = ["CHECK", "Interface", "LAUNCHER", "Recommendation", "VIRTUAL", "interfaces_of", "local_interfaces",
           "network_findings", "openmpi_include_args", "parse_ip_json", "parse_sysfs", "recommend"]


def parse_sysfs(items: Sequence[Mapping]) -> list[Interface]:
    """The probe's fallback (sysfs + ioctl, one IPv4 address per interface) → interfaces."""
    out = []
    for it in items:
        try:
            flags = int(it.get("flags") or "0", 16)
        except ValueError:
            flags = 0
        up = bool(flags & 0x1) and it.get("operstate") not in ("down", "lowerlayerdown")
        addrs = ()
        if it.get("inet"):
            addr, mask = it["inet"]
            addrs = (str(ipaddress.IPv4Interface(f"{addr}/{mask}")),)
        mtu = int(it["mtu"]) if str(it.get("mtu") or "").isdigit() else None
        out.append(Interface(it["ifname"], up, mtu, addrs))
    return out


def interfaces_of(report: Union[ProbeReport, Mapping]) -> list[Interface]:
    found = probe_report(report).interfaces
    if found.get("source") == "ip":
        return parse_ip_json(found.get("ip_json", "[]"))
    return parse_sysfs(found.get("sysfs") or [])


@dataclass(frozen=True)
class Recommendation:
    """The subnet to use and how to tell each layer (pure data; rendered by doctor)."""

    cidr: str
    ifaces: tuple[tuple[str, str], ...]  # (host, interface name on the subnet)
    reason: str
    launcher_on_it: bool = True

    @property
    def iface_names(self) -> list[str]:
        return sorted({i for _, i in self.ifaces})

    @property
    def nccl_socket_ifname(self) -> str:
        # '=' asks NCCL for an exact name rather than a prefix (eth1 would also match eth10).
        names = self.iface_names
        return f"={names[0]}" if len(names) == 1 else ",".join(names)

    def flags(self, flavor) -> dict:
        """Settings per layer for ``flavor`` (a launcher.flavors.Flavor, or None)."""
        out = {"dtrun": f"--include-iface {self.cidr}", "nccl": f"NCCL_SOCKET_IFNAME={self.nccl_socket_ifname}"}
        if flavor is None or flavor.is_openmpi:
            out["mpirun"] = " ".join(openmpi_include_args(self.cidr, flavor))
        else:
            names = self.iface_names
            out["mpirun"] = f"-iface {names[0]}" if len(names) == 1 else "(interface names differ: use -hosts with per-host addresses)"
        return out

    def to_dict(self, flavor=None) -> dict:
        return {"cidr": self.cidr, "interfaces": dict(self.ifaces), "reason": self.reason,
                "launcher_on_subnet": self.launcher_on_it, "flags": self.flags(flavor)}


def openmpi_include_args(cidr: str, flavor) -> list[str]:
    """The include flags dtrun itself emits (launcher.command), so the advice matches the launch."""
    flavor = flavor or Flavor(OPENMPI, (5, 0, 0))
    spec = cmd.LaunchSpec(program=("true",), hosts=(), np=1, include_iface=(cidr,), iface_reason="doctor")
    return [a for g in cmd.iface_groups_openmpi(spec, flavor) for a in g.args]


def _addr_owners(hosts: Mapping[str, Sequence[Interface]]) -> dict[str, list[tuple[str, str]]]:
    """IPv4 address → [(host, interface)] for every non-loopback address."""
    owners = defaultdict(list)
    for host, ifs in hosts.items():
        for i in ifs:
            for n in i.networks:
                if not n.ip.is_loopback:
                    owners[str(n.ip)].append((host, i.name))
    return owners


def recommend(hosts: Mapping[str, Sequence[Interface]], launcher: Optional[Sequence[Interface]] = None,
              reached: Optional[Mapping[str, str]] = None) -> Optional[Recommendation]:
    """The subnet every host (and the launcher, if given) has a distinct, usable address on.

    Candidates are the networks of up, non-loopback, non-virtual interfaces. Preferred:
    the subnet holding the addresses SSH reached the hosts at (``reached``), then the
    largest MTU, then the narrowest subnet. None when no subnet reaches every host.
    """
    every = dict(hosts)
    if launcher is not None:
        every[LAUNCHER] = list(launcher)
    rec = _best_subnet(every, reached or {})
    if rec is not None or launcher is None:
        return rec
    rec = _best_subnet(dict(hosts), reached or {})
    return None if rec is None else Recommendation(rec.cidr, rec.ifaces, rec.reason, launcher_on_it=False)


LAUNCHER = "(launching host)"


def _best_subnet(every: Mapping[str, Sequence[Interface]], reached: Mapping[str, str]) -> Optional[Recommendation]:
    owners = _addr_owners(every)
    candidates = {}
    for ifs in every.values():
        for i in ifs:
            if i.up and not i.virtual and not i.loopback:
                for n in i.networks:
                    candidates.setdefault(str(n.network), n.network)
    scored = []
    for cidr, net in candidates.items():
        members, mtus = [], []
        for host, ifs in every.items():
            hit = [(i, n) for i in ifs if i.up and not i.virtual for n in i.networks if n.ip in net]
            if not hit:
                break
            i, n = hit[0]
            if len(owners[str(n.ip)]) > 1:  # the same address on two hosts: unusable
                break
            members.append((host, i.name))
            mtus.append(i.mtu or 0)
        else:
            via_ssh = sum(1 for a in reached.values() if a and ipaddress.ip_address(a) in net)
            scored.append(((via_ssh, min(mtus), net.prefixlen), cidr, tuple(members), via_ssh))
    if not scored:
        return None
    scored.sort(reverse=True)
    _, cidr, members, via_ssh = scored[0]
    reason = "the subnet every host has an address on" + (", the one SSH reaches them by" if via_ssh else "")
    return Recommendation(cidr, tuple((h, i) for h, i in members if h != LAUNCHER), reason)


def network_findings(hosts: Mapping[str, Sequence[Interface]], rec: Optional[Recommendation],
                     launcher: Optional[Sequence[Interface]] = None) -> list[Finding]:
    """One or more findings per host: down/virtual/duplicate interfaces, MTU mismatch, the choice."""
    findings: list[Finding] = []
    owners = _addr_owners(hosts)
    fix_rec = (f"dtrun applies {rec.flags(None)['dtrun']} itself; for plain mpirun add {rec.flags(None)['mpirun']} "
               f"and set {rec.flags(None)['nccl']}") if rec else ""
    for host, ifs in hosts.items():
        for i in ifs:
            if i.loopback or not i.addrs:
                continue
            reasons = []
            if i.virtual:
                reasons.append("is a container or VM bridge, not a link to other hosts")
            if not i.up:
                reasons.append("is down")
            dup = sorted({h for a in i.networks for h, _ in owners[str(a.ip)] if h != host})
            if dup:  # every holder named, this host too: the same words on each (doctor groups them)
                holders = [h for h in hosts if h == host or h in dup]
                reasons.append(f"carries the same address on {', '.join(holders)}")
            if reasons:
                said = ", ".join(reasons[:-1]) + (" and " if len(reasons) > 1 else "") + reasons[-1]
                findings.append(Finding(
                    host, CHECK, WARN,
                    f"{i.name} ({', '.join(i.addrs)}) {said}: Open MPI and NCCL would try to reach peers through it "
                    f"and can hang",
                    fix_rec or f"keep MPI off {i.name}: --mca btl_tcp_if_exclude lo,{i.name}"))
    if rec is None:
        detail = "no IPv4 subnet reaches every host" + (" and this host" if launcher is not None else "")
        for host, ifs in hosts.items():
            nets = ", ".join(a for i in ifs if i.up and not i.loopback for a in i.addrs) or "none"
            findings.append(Finding(host, CHECK, FAIL, f"{detail}; {host} has {nets}",
                                    "put all hosts on one network, or route between them and name the interfaces "
                                    "with --include-iface"))
        return findings
    chosen = dict(rec.ifaces)
    mtus = {}
    for host, ifs in hosts.items():
        i = next((i for i in ifs if i.name == chosen.get(host)), None)
        if i is not None:
            mtus[host] = i.mtu
    common = Counter(mtus.values()).most_common(1)[0][0] if mtus else None
    for host in hosts:
        name = chosen.get(host)
        if mtus.get(host) != common:
            others = sorted(h for h, m in mtus.items() if m == common)
            findings.append(Finding(
                host, CHECK, WARN,
                f"{name} has MTU {mtus.get(host)} while {', '.join(others)} use {common} on {rec.cidr}: large "
                f"messages fragment or are dropped",
                f"set the same MTU on every host's interface on {rec.cidr} (ip link set {name} mtu {common})"))
        else:
            findings.append(Finding(host, CHECK, OK, f"{name} on {rec.cidr} (MTU {mtus.get(host)})"))
    if not rec.launcher_on_it:
        findings.append(Finding(LAUNCHER, CHECK, WARN,
                                f"this host has no address on {rec.cidr}, the subnet the hosts share: mpirun's "
                                f"daemons cannot call back to it over that subnet",
                                "launch from one of the hosts, or give this host an address on that network"))
    return findings
