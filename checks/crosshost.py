"""The doctor's rounds between hosts, once every probe has answered: firewall, ssh hops, links.

Each host's probe (still running, still holding its TCP listener) is sent a second
request: connect to every other host's listener (``checks/firewall.py``) and run the ssh
hops that Open MPI's tree spawn or ``--all-pairs`` needs (``checks/treespawn.py``). With
``--links``, each host in turn then measures its links to the others
(``checks/links.py``). This is the one part of the doctor that talks host to host, so it
is apart from the first round (``checks/doctor.py``), which talks only to each host.
"""
from __future__ import annotations

import ipaddress
import time
from typing import Optional

from dtrun.checks import firewall, links
from dtrun.checks.doctorhosts import MAX_WORKERS, DoctorHosts, HostRun
from dtrun.checks.errors import CheckError
from dtrun.checks.fanout import fan_out
from dtrun.checks.result import WARN, Finding
from dtrun.checks.treespawn import ssh_hops, ssh_pair_findings


def address_on(net, ifs) -> Optional[str]:
    """The first address of ``ifs`` inside ``net``."""
    for i in ifs or ():
        for n in i.networks:
            if n.ip in net:
                return str(n.ip)
    return None


def pairs_round(hosts: DoctorHosts, rec, ifaces, launcher_ifs, job_cfg, *, timeout: float, all_pairs: bool):
    """Second round with every live probe: TCP to every other listener, ssh where the tree needs it.

    Returns:
        (firewall and host-to-host ssh findings, {host: its connection results}).
    """
    net = ipaddress.ip_network(rec.cidr)
    live = [r for r in hosts.everyone if r.report and r.report.port and r.probe]
    endpoints = {}
    for r in live:
        a = address_on(net, launcher_ifs if r is hosts.helper else ifaces.get(r.name))
        if a:
            endpoints[r.name] = (a, r.report.port)
    plan = firewall.connect_plan(endpoints)
    ssh_pairs, why = ssh_hops(all_pairs, [r.name for r in hosts.runs], hosts.launcher_in_list)
    by_src = {}
    for a, b in ssh_pairs:
        by_src.setdefault(a, []).append([b, b])
    base = {"timeout": firewall.CONNECT_TIMEOUT_S, "ssh_config": job_cfg() if ssh_pairs else None,
            "ssh_timeout": timeout}
    requests = {r.name: dict(base, connect=plan.get(r.name, []), ssh=by_src.get(r.name, [])) for r in live}
    busy = [r for r in live if requests[r.name]["connect"] or requests[r.name]["ssh"]]
    answers = fan_out(busy, lambda r: _connect_pairs(r, requests[r.name], timeout), MAX_WORKERS)
    results = {name: out.get("connect", {}) for name, out in answers.ok.items()}
    findings = firewall.firewall_findings(results, endpoints, rec.cidr) if len(endpoints) > 1 else []
    findings += ssh_pair_findings({name: out.get("ssh", {}) for name, out in answers.ok.items()}, why,
                                  bool(all_pairs))
    return findings + answers.findings("firewall"), results


def _connect_pairs(r: HostRun, req: dict, timeout: float) -> dict:
    """One host's probe connects to the others' listeners and runs its ssh hops; its answer."""
    r.step = "firewall: connecting"
    t0 = time.monotonic()
    try:
        r.probe.send(req)
        # The probe connects all at once, and runs its ssh hops 32 at a time, each within ssh_timeout + 5 s.
        batches = -(-len(req["ssh"]) // 32)
        out = r.probe.read(firewall.CONNECT_TIMEOUT_S + timeout + batches * (req["ssh_timeout"] + 5),
                           "firewall probe")
        r.step = "firewall: done"
        return out
    finally:
        r.times["pairs"] = time.monotonic() - t0


def links_round(hosts: DoctorHosts, rec, ifaces, *, timeout: float, sample: Optional[int]):
    """--links: each host in turn measures its links to the others (checks/links.py).

    Returns:
        (findings, the stage's summary for the report).
    """
    t0 = time.monotonic()
    net = ipaddress.ip_network(rec.cidr)
    live = {r.name: r for r in hosts.runs if r.report and r.report.links_port and r.probe}
    endpoints = {}
    for name, r in live.items():
        a = address_on(net, ifaces.get(name))
        if a:
            endpoints[name] = (a, r.report.links_port)
    names = [r.name for r in hosts.runs if r.name in endpoints]
    plan = links.plan(names, sample)
    results, errors = _measure_links(live, endpoints, plan, timeout)
    suspects = links.suspects(results)
    if suspects:  # measure them again; keep the better figures (a scheduler hiccup does not repeat)
        again, _ = _measure_links(live, endpoints, suspects, timeout)
        for p, res in again.items():
            results[p] = links.better(results[p], res)
    found = links.link_findings(results, names) + errors
    return found, links.summary(results, time.monotonic() - t0)


def _measure_links(live: dict, endpoints: dict, pairs, timeout: float) -> tuple[dict, list]:
    """Measure ``pairs`` one source host at a time: ({(src, dst): result}, findings for hosts that failed)."""
    base = {"timeout": timeout, "max_bytes": links.MAX_BYTES, "max_seconds": links.MAX_SECONDS,
            "pings": links.PINGS}
    by_src: dict = {}
    for a, b in pairs:
        by_src.setdefault(a, []).append([b, *endpoints[b]])
    out, errors = {}, []
    for src, targets in by_src.items():  # one host at a time: no two transfers share a link
        r = live[src]
        r.step = "links: measuring"
        try:
            r.probe.send(dict(base, links=targets))
            per = 2 * timeout + 4 * links.MAX_SECONDS + 1
            answer = r.probe.read(len(targets) * per + timeout, "link probe").get("links", {})
        except CheckError as exc:
            errors.append(Finding(src, links.CHECK, WARN, f"links not measured: {exc.detail}"))
            continue
        for dst, res in answer.items():
            out[(src, dst)] = res
        r.step = "links: done"
    return out, errors
