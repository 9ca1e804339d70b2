"""``dtrun doctor``: the checklist users go through when mpirun hangs, on every host at once.

Per host, in a bounded thread pool: one SSH connection (``checks/ssh.py``), one run
of the probe over it (``launcher/remote/probe.py``), which reports the environment
and interfaces and keeps a TCP listener open; then, once every probe has answered,
each probe connects to every other host's listener (firewall) and, where Open
MPI's tree spawn or ``--all-pairs`` needs it, ssh-es to other hosts. This host
takes part too, since mpirun runs here. Then, when nothing failed, a real job
through dtrun with the recommended flags (``checks/e2e.py``). A dead host costs
its connect timeout and never holds up the others.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from dtrun.checks import env, firewall, gpu, network
from dtrun.checks import e2e as e2e_check
from dtrun.checks.errors import CheckError
from dtrun.checks.probereport import ProbeReport, probe_report
from dtrun.checks.result import CHECKS, FAIL, NA, OK, SYMBOL, WARN, Finding, worst
from dtrun.launcher.errors import ExitCode, UsageError
from dtrun.launcher.hosts import HostOptions

MAX_WORKERS = 32


@dataclass(frozen=True, kw_only=True)
class DoctorSpec:
    """What ``dtrun doctor`` was asked to do."""

    hosts: HostOptions = HostOptions()
    timeout: float = 5.0
    json: bool = False
    all_pairs: bool = False
    program: Optional[str] = None
    e2e: bool = True
    e2e_timeout: Optional[float] = None  # default: e2e.E2E_TIMEOUT_S
    links: bool = False  # --links: bandwidth and latency between hosts (checks/links.py)
    links_sample: Optional[int] = None  # random pairs beyond the ring (default: as many as hosts)


@dataclass
class HostRun:
    """One host's state while doctor runs (its connection, probe and report, set by its worker)."""

    name: str
    slots: int
    local: bool
    target: object = None
    conn: object = None
    probe: object = None
    report: Optional[ProbeReport] = None  # parsed as it arrives (checks/probereport.py)
    times: dict = field(default_factory=dict)
    step: str = "waiting"


@dataclass(frozen=True)
class _Hosts:
    """The job's hosts, plus this host as a helper when it is not one of them (mpirun runs here)."""

    runs: list
    helper: Optional[HostRun]

    @property
    def everyone(self) -> list:
        return self.runs + ([self.helper] if self.helper else [])

    @property
    def launcher_in_list(self) -> bool:
        return self.helper is None

    def order(self) -> dict:
        return {r.name: i for i, r in enumerate(self.everyone)}


@dataclass
class DoctorReport:
    hosts: list
    findings: list
    recommendation: Optional[dict] = None
    timings: dict = field(default_factory=dict)
    e2e: Optional[dict] = None
    firewall_pairs: dict = field(default_factory=dict)
    interfaces: dict = field(default_factory=dict)  # host -> [{name, up, mtu, addrs}]
    links: Optional[dict] = None  # --links: the stage's pairs, medians and outliers

    @property
    def exit_code(self) -> int:
        return ExitCode.FAILED if any(f.status == FAIL for f in self.findings) else ExitCode.OK

    def cell(self, host: str, check: str) -> str:
        return worst(f.status for f in self.findings if f.host == host and f.check == check)

    def to_dict(self) -> dict:
        return {"hosts": self.hosts, "exit_code": int(self.exit_code),
                "summary": {h: {c: self.cell(h, c) for c in CHECKS} for h in self.hosts},
                "findings": [f.to_dict() for f in self.findings], "recommendation": self.recommendation,
                "interfaces": self.interfaces, "firewall_pairs": self.firewall_pairs, "e2e": self.e2e,
                "links": self.links,
                "timings": self.timings}


def radix_parent(vpid: int, radix: int) -> int:
    """The daemon that starts daemon ``vpid`` in Open MPI's routing tree (-1 for mpirun, vpid 0).

    PRRTE's routed/radix (and ORTE's before it) numbers the tree by levels of radix**k
    daemons: daemon v at a level of L daemons starts v+L, v+2L, ... v+radix*L, so a
    level's children are interleaved across its daemons (with radix 64: 1 starts 65, 129,
    ...; 2 starts 66, 130, ...).
    """
    if vpid <= 0:
        return -1
    total, in_level = 1, 1
    while total < vpid + 1:
        in_level *= radix
        total += in_level
    first = total - in_level  # the first vpid of vpid's level
    in_prev = in_level // radix
    return (vpid - first) % in_prev + (first - in_prev)


def tree_spawn_pairs(hosts: list[str], radix: int, launcher_in_list: bool = False) -> list[tuple[str, str]]:
    """(parent, child) ssh hops of Open MPI's routing tree (pure).

    mpirun is daemon 0; the hosts get daemons 1..N in order (or 0..N-1 when this host is
    one of them), as PRRTE's ``plm_base_verbose`` shows ("assigning new daemon [..,65] to
    node h65"). Daemon 0 is this host, whose own ssh the ssh check already covers.
    """
    offset = 0 if launcher_in_list else 1
    by_vpid = {i + offset: h for i, h in enumerate(hosts)}
    pairs = []
    for v, h in sorted(by_vpid.items()):
        parent = radix_parent(v, radix)
        if parent > 0 and parent in by_vpid:
            pairs.append((by_vpid[parent], h))
    index = {h: i for i, h in enumerate(hosts)}
    return sorted(pairs, key=lambda p: (index[p[0]], index[p[1]]))


class Progress:
    """A live line per host on stderr while doctor runs (only on a terminal), gone afterwards."""

    def __init__(self, enabled: bool):
        self.enabled, self.runs, self.live = enabled, [], None

    def show(self, runs: list[HostRun]) -> None:
        self.runs = runs
        if self.enabled and runs:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(get_renderable=self._render, console=Console(stderr=True), refresh_per_second=8,
                             transient=True)
            self.live.start()

    def _render(self):
        from rich.text import Text

        width = max(len(r.name) for r in self.runs)
        return Text("\n".join(f"{r.name.ljust(width)}  {r.step}" for r in self.runs))

    def stop(self) -> None:
        if self.live:
            self.live.stop()
            self.live = None


def run_doctor(spec: DoctorSpec) -> int:
    """Resolve the hosts, run every check, print the table (or JSON); return the exit code."""
    import threading

    from dtrun.checks import ssh
    from dtrun.launcher.hosts import resolve_hosts
    from dtrun.launcher.safe import seconds

    # paramiko's import (~60 ms) goes on while the hosts are resolved and this host's probe starts.
    threading.Thread(target=ssh.import_paramiko, name="import-paramiko", daemon=True).start()
    seconds(spec.timeout, "--timeout")
    if spec.e2e_timeout is not None:
        seconds(spec.e2e_timeout, "--e2e-timeout")
    if spec.program and not os.path.exists(spec.program):
        raise UsageError(f"--program {spec.program}: no such file on this host")
    selection = resolve_hosts(spec.hosts)
    report = diagnose(spec, selection, live=not spec.json and sys.stderr.isatty())
    if spec.json:
        import json

        print(json.dumps(report.to_dict(), indent=2))
    else:
        render(report)
    return report.exit_code


def diagnose(spec: DoctorSpec, selection, live: bool = False) -> DoctorReport:
    """Every check on every host of ``selection``; the report with one or more findings per host and check."""
    progress = Progress(live)
    try:
        return _diagnose(spec, selection, progress)
    finally:
        progress.stop()


def _diagnose(spec: DoctorSpec, selection, progress: "Progress") -> DoctorReport:
    from dtrun.checks import ssh

    t_start = time.monotonic()
    flavor, cfg_path, hosts, request = _prepare(spec, selection)
    job_cfg = lambda: _job_ssh_config(selection, cfg_path)  # noqa: E731  (written only if needed)
    progress.show(hosts.runs)
    try:
        answers = ssh.fan_out(hosts.everyone, lambda r: _connect_and_probe(spec, r, request), MAX_WORKERS)
        t_a = time.monotonic()
        findings = [f for found in answers.ok.values() for f in found]
        by_name = {r.name: r for r in hosts.everyone}  # no connection yet: ssh failed; else the probe did
        findings += answers.findings(lambda name: "env" if by_name[name].conn or by_name[name].local else "ssh")
        analysis = _analyse(spec, flavor, hosts)
        findings += analysis.findings
        rec, parsed = analysis.recommendation, analysis.interfaces
        fw_pairs, links_summary = {}, None
        if rec is not None:
            found, fw_pairs = _pairs_phase(spec, hosts, rec, analysis.placed, analysis.launcher_interfaces, job_cfg)
            findings += found
        t_links = time.monotonic()
        if spec.links and rec is not None:
            found, links_summary = _links_phase(spec, hosts, rec, analysis.placed)
            findings += found
    finally:
        for r in hosts.everyone:
            if r.probe:
                r.probe.close()
            if r.conn:
                r.conn.close()
    t_pairs = time.monotonic()
    if links_summary is None:
        t_links = t_pairs
    findings += _not_checked(hosts.runs, findings, rec)
    found, e2e_summary = _end_to_end(spec, hosts.runs, findings, flavor, rec, job_cfg)
    findings += found
    order = hosts.order()
    findings.sort(key=lambda f: (order.get(f.host, len(order)), CHECKS.index(f.check) if f.check in CHECKS else 99))
    timings = {
        "total": round(time.monotonic() - t_start, 3),
        "connect_and_probe": round(t_a - t_start, 3),
        "pairs": round(t_links - t_a, 3),
        "links": round(t_pairs - t_links, 3),
        "per_host": {r.name: {k: round(v, 3) for k, v in r.times.items()} for r in hosts.everyone},
    }
    helper = hosts.helper
    helper_found = helper is not None and any(f.host == helper.name for f in findings)
    names = [r.name for r in hosts.runs] + ([helper.name] if helper_found else [])
    interfaces = {h: [dataclasses.asdict(i) for i in ifs] for h, ifs in parsed.items()}
    return DoctorReport(names, findings, rec.to_dict(flavor) if rec else None, timings, e2e_summary, fw_pairs,
                        interfaces, links_summary)


def _prepare(spec: DoctorSpec, selection):
    """The MPI flavor, the ssh config, the hosts (local probes already started) and the probe request."""
    from dtrun.checks import ssh
    from dtrun.checks.probe import start_probe
    from dtrun.launcher.flavors import detect_flavor, find_mpirun
    from dtrun.launcher.hosts import is_local
    from dtrun.launcher.sshconf import job_ssh_files

    flavor = detect_flavor(find_mpirun())
    cfg_path = ssh.ssh_config_path(spec.hosts.ssh_config, selection.ssh_config)
    job_ssh_files(selection, cfg_path, openmpi=True)  # the config the job would get must be expressible: check now
    runs = [HostRun(h.host, h.slots, is_local(h.host)) for h in selection.hosts]
    hosts = _Hosts(runs, None if any(r.local for r in runs) else HostRun(network.LAUNCHER, 0, True))
    # The probes only need paths; the local facts are completed from the local probe's answer.
    request = dict(env.local_facts(flavor, None, spec.program).probe_request(), listen=True, gpu=True,
                   links=spec.links)
    for r in hosts.everyone:
        if r.local:  # starts now, so that it runs while paramiko is imported and the hosts connect
            # Only this host's interfaces and listener are needed when it is not one of the job's hosts.
            own = dict(request, versions=False) if r is not hosts.helper else dict(request, versions=False, gpu=False,
                                                                                   mpi_load=False, links=False)
            r.probe = start_probe(r.name, None, own, spec.timeout)
    if not all(r.local for r in runs):
        config = ssh.load_ssh_config(cfg_path)
        for r, h in zip(runs, selection.hosts):
            if not r.local:
                r.target = ssh.ssh_target(h, config, cfg_path)
    return flavor, cfg_path, hosts, request


def _connect_and_probe(spec: DoctorSpec, r: HostRun, request: dict) -> list[Finding]:
    """First round, one host: ssh (unless local), start the probe, read its report.

    Raises:
        CheckError: the host cannot be reached or its probe did not answer.
    """
    from dtrun.checks import ssh
    from dtrun.checks.probe import start_probe

    t0 = time.monotonic()
    try:
        if r.local:
            found = [Finding(r.name, "ssh", NA, "this host: no SSH needed")]
        else:
            r.step = "ssh: connecting"
            r.conn = ssh.connect(r.target, spec.timeout)
            r.times["ssh"] = r.conn.timings["total"]
            found = [Finding(r.name, "ssh", OK, f"{r.target.user}@{r.target.where} with "
                             f"{os.path.basename(r.conn.key_label)} in {r.conn.timings['total']:.2f} s; "
                             f"host key {r.conn.host_key} known")]
            r.step = "probe: running"
            r.probe = start_probe(r.name, r.conn, request, spec.timeout)
        t1 = time.monotonic()
        r.report = probe_report(r.probe.read(max(3 * spec.timeout, 10.0), "probe"))
        r.times["probe"] = time.monotonic() - t1
        r.step = "probe: done"
        return found
    except CheckError as exc:
        r.step = f"✗ {exc.detail[:60]}"
        raise
    finally:
        r.times["phase_a"] = time.monotonic() - t0


@dataclass(frozen=True)
class Analysis:
    """What the probe reports say, read together: findings and the subnet to use."""

    findings: list
    recommendation: Optional[network.Recommendation]
    placed: dict  # {host: interfaces} of the hosts to place on the subnet
    launcher_interfaces: Optional[list]  # this host's interfaces when it only helps (not in the list)
    interfaces: dict  # {host: interfaces} of every report


def _analyse(spec: DoctorSpec, flavor, hosts: _Hosts) -> Analysis:
    """After every probe answered: env, network and GPU findings, and the subnet to use."""
    runs, helper = hosts.runs, hosts.helper
    findings: list[Finding] = []
    local_report = next((r.report for r in hosts.everyone if r.local and r.report), None)
    facts = env.local_facts(flavor, local_report, spec.program)
    probed = [r for r in runs if r.report and r.report.ok]
    parsed = {r.name: network.interfaces_of(r.report) for r in hosts.everyone if r.report and r.report.ok}
    for r in runs:
        if r.report:
            findings += env.env_findings(r.name, r.report, facts, is_this_host=r.local)
    findings += env.consistency_findings({r.name: r.report for r in runs if r.report and not r.local}, facts)
    # No network to choose when every rank runs on this host: MPI uses shared memory.
    ifaces = {r.name: parsed[r.name] for r in probed}
    if all(r.local for r in runs):
        findings += [Finding(r.name, c, NA, "this host only: ranks talk through shared memory")
                     for r in runs for c in ("network", "firewall")]
        ifaces = {}
    launcher_ifs = parsed.get(helper.name) if helper else None
    reached = {r.name: r.conn.transport.getpeername()[0] for r in runs if r.conn}
    rec = network.recommend(ifaces, launcher_ifs, reached) if ifaces else None
    if ifaces:
        findings += network.network_findings(ifaces, rec, launcher_ifs)
    findings += gpu.gpu_findings([gpu.host_gpus(r.name, r.slots, r.report) for r in probed])
    return Analysis(findings, rec, ifaces, launcher_ifs, parsed)


def _not_checked(runs, findings, rec) -> list[Finding]:
    """An NA finding, with the reason, for every check that could not run on a host."""
    out = []
    for r in runs:
        for check in ("env", "network", "firewall", "gpu"):
            if not any(f.host == r.name and f.check == check for f in findings):
                why = ("no connection to the host" if not r.report else
                       "no subnet shared by all hosts" if rec is None else "no other host to connect to")
                out.append(Finding(r.name, check, NA, f"not checked: {why}"))
    return out


def _end_to_end(spec: DoctorSpec, runs, findings, flavor, rec, job_cfg):
    """A real job through dtrun with the recommended flags, when nothing failed; (findings, summary)."""
    if not spec.e2e:
        return [Finding(r.name, "e2e", NA, "skipped (--no-e2e)") for r in runs], None
    if any(f.status == FAIL for f in findings):
        return [Finding(r.name, "e2e", NA, "skipped: fix the failures above first") for r in runs], None
    for r in runs:
        r.step = "end to end: running a job through dtrun"
    names = {r.report.hostname: r.name for r in runs if r.report and r.report.hostname}
    flags = rec.flags(flavor)["dtrun"] if rec else ""
    return e2e_check.end_to_end([r.name for r in runs], job_cfg(), rec.cidr if rec else None, names,
                                spec.e2e_timeout or e2e_check.E2E_TIMEOUT_S, flags_text=flags)


def _job_ssh_config(selection, cfg_path: Optional[str]) -> Optional[str]:
    """The ssh config mpirun gets: the user's, plus the cluster file's per-host settings."""
    from dtrun.launcher.sshconf import write_job_config

    return write_job_config(selection, cfg_path)


def _address_on(net, ifs) -> Optional[str]:
    """The first address of ``ifs`` inside ``net``."""
    for i in ifs or ():
        for n in i.networks:
            if n.ip in net:
                return str(n.ip)
    return None


def _ssh_hops(spec: DoctorSpec, names: list, launcher_in_list: bool):
    """Which host-to-host ssh hops to try, and why (pure)."""
    from dtrun.launcher.command import tree_radix

    if spec.all_pairs:
        return [(a, b) for a in names for b in names if a != b], "--all-pairs"
    radix = tree_radix(os.environ)
    return (tree_spawn_pairs(names, radix, launcher_in_list),
            f"{len(names)} hosts: Open MPI's daemons start each other over ssh (tree spawn, radix {radix})")


def _pairs_phase(spec: DoctorSpec, hosts: _Hosts, rec, ifaces, launcher_ifs, job_cfg):
    """Second round with every live probe: TCP to every other listener, ssh where the tree needs it.

    Returns:
        (firewall and host-to-host ssh findings, {host: its connection results}).
    """
    import ipaddress

    from dtrun.checks import ssh

    net = ipaddress.ip_network(rec.cidr)
    live = [r for r in hosts.everyone if r.report and r.report.port and r.probe]
    endpoints = {}
    for r in live:
        a = _address_on(net, launcher_ifs if r is hosts.helper else ifaces.get(r.name))
        if a:
            endpoints[r.name] = (a, r.report.port)
    plan = firewall.connect_plan(endpoints)
    ssh_pairs, why = _ssh_hops(spec, [r.name for r in hosts.runs], hosts.launcher_in_list)
    by_src = {}
    for a, b in ssh_pairs:
        by_src.setdefault(a, []).append([b, b])
    base = {"timeout": firewall.CONNECT_TIMEOUT_S, "ssh_config": job_cfg() if ssh_pairs else None,
            "ssh_timeout": spec.timeout}
    requests = {r.name: dict(base, connect=plan.get(r.name, []), ssh=by_src.get(r.name, [])) for r in live}
    busy = [r for r in live if requests[r.name]["connect"] or requests[r.name]["ssh"]]
    answers = ssh.fan_out(busy, lambda r: _connect_pairs(spec, r, requests[r.name]), MAX_WORKERS)
    results = {name: out.get("connect", {}) for name, out in answers.ok.items()}
    findings = firewall.firewall_findings(results, endpoints, rec.cidr) if len(endpoints) > 1 else []
    findings += ssh_pair_findings({name: out.get("ssh", {}) for name, out in answers.ok.items()}, why,
                                  bool(spec.all_pairs))
    return findings + answers.findings("firewall"), results


def _links_phase(spec: DoctorSpec, hosts: _Hosts, rec, ifaces):
    """--links: each host in turn measures its links to the others (checks/links.py).

    Returns:
        (findings, the stage's summary for the report).
    """
    import ipaddress

    from dtrun.checks import links

    t0 = time.monotonic()
    net = ipaddress.ip_network(rec.cidr)
    live = {r.name: r for r in hosts.runs if r.report and r.report.links_port and r.probe}
    endpoints = {}
    for name, r in live.items():
        a = _address_on(net, ifaces.get(name))
        if a:
            endpoints[name] = (a, r.report.links_port)
    names = [r.name for r in hosts.runs if r.name in endpoints]
    plan = links.plan(names, spec.links_sample)
    base = {"timeout": spec.timeout, "max_bytes": links.MAX_BYTES, "max_seconds": links.MAX_SECONDS,
            "pings": links.PINGS}

    def measure(pairs) -> tuple[dict, list]:
        by_src: dict = {}
        for a, b in pairs:
            by_src.setdefault(a, []).append([b, *endpoints[b]])
        out, errors = {}, []
        for src, targets in by_src.items():  # one host at a time: no two transfers share a link
            r = live[src]
            r.step = "links: measuring"
            try:
                r.probe.send(dict(base, links=targets))
                per = 2 * spec.timeout + 4 * links.MAX_SECONDS + 1
                answer = r.probe.read(len(targets) * per + spec.timeout, "link probe").get("links", {})
            except CheckError as exc:
                errors.append(Finding(src, links.CHECK, WARN, f"links not measured: {exc.detail}"))
                continue
            for dst, res in answer.items():
                out[(src, dst)] = res
            r.step = "links: done"
        return out, errors

    results, errors = measure(plan)
    suspects = links.suspects(results)
    if suspects:  # measure them again; keep the better figures (a scheduler hiccup does not repeat)
        again, _ = measure(suspects)
        for p, res in again.items():
            results[p] = links.better(results[p], res)
    found = links.link_findings(results, names) + errors
    return found, links.summary(results, time.monotonic() - t0)


def _connect_pairs(spec: DoctorSpec, r: HostRun, req: dict) -> dict:
    """One host's probe connects to the others' listeners and runs its ssh hops; its answer."""
    r.step = "firewall: connecting"
    t0 = time.monotonic()
    try:
        r.probe.send(req)
        # The probe connects all at once, and runs its ssh hops 32 at a time, each within ssh_timeout + 5 s.
        batches = -(-len(req["ssh"]) // 32)
        out = r.probe.read(firewall.CONNECT_TIMEOUT_S + spec.timeout + batches * (req["ssh_timeout"] + 5),
                           "firewall probe")
        r.step = "firewall: done"
        return out
    finally:
        r.times["pairs"] = time.monotonic() - t0


def ssh_pair_findings(results: dict, why: str, all_pairs: bool) -> list[Finding]:
    """Host-to-host ssh outcomes → findings on the source host (pure)."""
    out = []
    for src, row in results.items():
        if not row:
            continue
        bad = {dst: r for dst, r in row.items() if r[0] != 0}
        if bad:
            text = "; ".join(f"{src} → {dst}: {(r[2] or 'exit ' + str(r[0])).splitlines()[-1]}" for dst, r in bad.items())
            fix = ("pass --no-tree-spawn to dtrun (mpirun: --prtemca plm_ssh_no_tree_spawn 1) so that only this "
                   f"host uses ssh, or let {src} log in to {', '.join(bad)} with a key and a known host key")
            out.append(Finding(src, "ssh", FAIL, f"ssh between hosts fails ({why}): {text}", fix))
        else:
            out.append(Finding(src, "ssh", OK, f"ssh from {src} to {len(row)} other host(s) works ({why})"))
    return out


_HOST = "\x00host\x00"  # stands for a finding's own host name while findings are compared
# Where a host's name reads as prose ("on h1", "h1's PATH"), "each host" can stand for several;
# elsewhere (`ssh h1 ...`, "--exclude h1") it is part of a command and must stay one name.
_PROSE = re.compile(r"\b(?:on|to|in|from|of|at) " + re.escape(_HOST))
_RANGE = re.compile(r"\[[^\]]*\d-\d")
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class FindingGroup:
    """One finding as shown: the hosts it holds for (in the report's order) and its words."""

    hosts: tuple[str, ...]
    check: str
    status: str
    detail: str
    fix: str = ""


def host_names(names) -> str:
    """Several hosts in a few characters: ``hnode[1-4]`` where python-hostlist finds a range, else a comma list."""
    names = list(names)
    if len(names) > 1 and all(_HOST_NAME.fullmatch(n) for n in names):
        try:
            import hostlist

            text = hostlist.collect_hostlist(names)
        except Exception:  # noqa: BLE001 (python-hostlist raises its own and ValueError): the plain list serves
            text = ""
        if _RANGE.search(text):
            return text
    return ", ".join(names)


def _templated(f: Finding) -> Optional[tuple[str, str]]:
    """(detail, fix) with the finding's own host name replaced by a marker, when every mention reads
    as prose (so "each host" can stand for it); None when the text does not name its host, or names
    it inside a command."""
    own = re.compile(r"(?<![A-Za-z0-9_.-])" + re.escape(f.host) + r"(?![A-Za-z0-9_-])(?!\.[A-Za-z0-9])")
    detail, fix = own.sub(_HOST, f.detail), own.sub(_HOST, f.fix)
    if (detail, fix) == (f.detail, f.fix):
        return None
    for text in (detail, fix):
        if text.count(_HOST) != len(_PROSE.findall(text)):
            return None
    return detail, fix


def group_findings(findings, order=None) -> list[FindingGroup]:
    """Findings that say the same thing about several hosts, as one group each (pure).

    Two findings are the same when check, status, detail and fix are equal, or equal once
    each one's own host name is taken out (``prted is not on h1's PATH`` and ``... on h2's
    PATH``); the host then reads "each host". Groups keep the order of their first finding.
    """
    exact: dict = {}
    for f in findings:
        exact.setdefault((f.check, f.status, f.detail, f.fix), []).append(f)
    merged: dict = {}
    for key, members in exact.items():
        t = _templated(members[0]) if len(members) == 1 else None
        merged.setdefault(("each", key[0], key[1], *t) if t else ("same", *key), []).extend(members)
    out = []
    for key, members in merged.items():
        hosts = tuple(dict.fromkeys(f.host for f in members))
        if order is not None:
            hosts = tuple(sorted(hosts, key=lambda h: order.get(h, len(order))))
        first = members[0]
        if key[0] == "each" and len(hosts) > 1:
            detail, fix = key[3].replace(_HOST, "each host"), key[4].replace(_HOST, "each host")
        else:
            detail, fix = first.detail, first.fix
        out.append(FindingGroup(hosts, first.check, first.status, detail, fix))
    return out


def render(report: DoctorReport) -> None:
    """The table (rows hosts, columns checks), then every finding that is not ok, with its fix."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("host")
    for c in CHECKS:
        table.add_column(c, justify="center")
    style = {OK: "green", WARN: "yellow", FAIL: "bold red", NA: "dim"}
    for h in report.hosts:
        cells = [report.cell(h, c) for c in CHECKS]
        table.add_row(h, *(f"[{style[s]}]{SYMBOL[s]}[/]" for s in cells))
    console.print(table)
    order = {h: i for i, h in enumerate(report.hosts)}
    bad = group_findings([f for f in report.findings if f.status in (FAIL, WARN)], order)
    if bad:
        console.print()
    for g in bad:  # a finding that holds for several hosts is shown once, naming them all
        print(f"{SYMBOL[g.status]} {host_names(g.hosts)} [{g.check}] {g.detail}")
        if g.fix:
            print(f"    fix: {g.fix}")
    rec = report.recommendation
    if rec:
        flags = rec["flags"]
        print(f"\nnetwork: use {rec['cidr']} ({rec['reason']}): dtrun applies {flags['dtrun']} itself; "
              f"mpirun: {flags['mpirun']}; NCCL: {flags['nccl']}")
    if report.links:
        lk = report.links
        rate = f"{lk['median_mbps'] / 1000:.1f} Gb/s" if lk.get("median_mbps") else "n/a"
        rtt = f"{lk['median_rtt_ms']:.2f} ms" if lk.get("median_rtt_ms") is not None else "n/a"
        print(f"links: {lk['pairs']} pairs measured in {lk['seconds']:.1f} s; median {rate}, round trip {rtt}; "
              f"{len(lk['slow_pairs'])} slow")
    if report.e2e and report.e2e.get("stages"):
        stages = ", ".join(f"{s} {t:.2f} s" for s, t in report.e2e["stages"].items())
        print(f"end to end: {stages}")
    n = len([h for h in report.hosts if h != network.LAUNCHER])
    fails = sum(1 for g in bad if g.status == FAIL)
    warns = sum(1 for g in bad if g.status == WARN)
    verdict = "all checks passed" if not fails and not warns else f"{fails} failed, {warns} warnings"
    print(f"doctor: {n} host{'s' if n != 1 else ''}, {verdict} ({report.timings.get('total', 0):.1f} s)")
