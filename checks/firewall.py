"""Can every host open a TCP connection to every other, on the subnet MPI will use?

Each host's probe listens on an ephemeral port; each then connects to every other
host's listener (and this host joins in, since mpirun and its daemons talk to it
too). ``connect_plan`` and ``firewall_findings`` are pure: the plan lists who
connects where, the findings name every blocked pair and the host most likely to
blame (the one every connection into, or out of, fails).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping

from dtrun.checks.result import FAIL, OK, Finding

CHECK = "firewall"
CONNECT_TIMEOUT_S = 2.0


def connect_plan(endpoints: Mapping[str, tuple[str, int]]) -> dict[str, list[list]]:
    """{source: [[destination, address, port], ...]} for every ordered pair of distinct participants."""
    return {src: [[dst, addr, port] for dst, (addr, port) in endpoints.items() if dst != src]
            for src in endpoints}


def _why(status: str, msg: str) -> str:
    return {"timeout": "timed out", "refused": "was refused"}.get(status, f"failed ({msg})")


def firewall_findings(results: Mapping[str, Mapping[str, list]], endpoints: Mapping[str, tuple[str, int]],
                      cidr: str, timeout: float = CONNECT_TIMEOUT_S) -> list[Finding]:
    """Findings from {source: {destination: [status, seconds, message]}}.

    A destination that no source reaches is blamed for dropping inbound traffic; a source
    that reaches no destination for blocking outbound; anything else is named as a pair.
    """
    failed = [(src, dst, r) for src, row in results.items() for dst, r in row.items() if r[0] != "ok"]
    tried_in, tried_out = defaultdict(int), defaultdict(int)
    for src, row in results.items():
        for dst in row:
            tried_in[dst] += 1
            tried_out[src] += 1
    failed_in, failed_out = defaultdict(int), defaultdict(int)
    for src, dst, _ in failed:
        failed_in[dst] += 1
        failed_out[src] += 1

    def all_in(h):
        return tried_in[h] > 0 and failed_in[h] == tried_in[h]

    def all_out(h):
        return tried_out[h] > 0 and failed_out[h] == tried_out[h]

    blame = defaultdict(list)  # host to blame -> [(source, destination, result)]
    for src, dst, r in failed:
        blame[src if all_out(src) and not all_in(dst) else dst].append((src, dst, r))
    findings = []
    for host, bad in blame.items():
        pairs = describe_pairs(bad, endpoints)
        timed_out = any(r[0] == "timeout" for _, _, r in bad)
        if all_in(host):
            cause = (f"{host} drops incoming TCP other than SSH (a firewall)" if timed_out
                     else f"{host} rejects incoming TCP other than SSH (a firewall)")
            fix = (f"open TCP between the hosts on {cidr} in {host}'s firewall (e.g. iptables -I INPUT -s {cidr} "
                   f"-p tcp -j ACCEPT); MPI and NCCL use ephemeral ports, so opening one port is not enough")
        elif all_out(host):
            cause = f"{host} cannot open TCP connections to the others (outgoing traffic blocked)"
            fix = f"allow outgoing TCP to {cidr} in {host}'s firewall"
        else:
            cause = "these pairs are blocked while others work (a per-host rule or a route)"
            fix = "compare the firewall rules and routes of the hosts named (iptables -S; ip route)"
        after = f" after {timeout:g} s" if timed_out else ""
        findings.append(Finding(host, CHECK, FAIL, f"{pairs}{after}: {cause}", fix))
    for host in endpoints:
        if host not in blame:
            others = len(endpoints) - 1
            findings.append(Finding(host, CHECK, OK, f"TCP on ephemeral ports to and from the {others} other "
                                                     f"participant{'s' if others != 1 else ''} on {cidr}"))
    return findings


def describe_pairs(bad, endpoints) -> str:
    """"a, b → c:41213 timed out; c → d:40000 was refused": every blocked pair, grouped by destination."""
    groups = defaultdict(list)
    order = {h: i for i, h in enumerate(endpoints)}
    for src, dst, r in sorted(bad, key=lambda b: order.get(b[0], len(order))):
        groups[(dst, _why(r[0], r[2]))].append(src)
    return "; ".join(f"{', '.join(srcs)} → {dst}:{endpoints[dst][1]} {why}" for (dst, why), srcs in groups.items())
