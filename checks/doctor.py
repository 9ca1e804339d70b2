"""``dtrun doctor``: the checklist users go through when mpirun hangs, on every host at once.

Per host, in a bounded thread pool: one SSH connection (``checks/ssh.py``), one run
of the probe over it (``checks/remote_probe.py``), which reports the environment
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
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from checks import env, firewall, gpu, network
from checks import e2e as e2e_check
from checks.errors import CheckError
from checks.result import CHECKS, FAIL, NA, OK, SYMBOL, WARN, Finding, from_error, worst
from launcher.errors import ExitCode, UsageError

MAX_WORKERS = 32


@dataclass(frozen=True)
class DoctorSpec:
    """What ``dtrun doctor`` was asked to do."""

    host_list: Optional[str] = None
    hostfile: Optional[str] = None
    cluster: Optional[str] = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    ssh_config: Optional[str] = None
    timeout: float = 5.0
    json: bool = False
    all_pairs: bool = False
    program: Optional[str] = None
    e2e: bool = True
    e2e_timeout: Optional[float] = None  # default: e2e.E2E_TIMEOUT_S


@dataclass
class HostRun:
    """One host's state while doctor runs (filled in by that host's worker)."""

    name: str
    slots: int
    local: bool
    target: object = None
    conn: object = None
    probe: object = None
    report: Optional[dict] = None
    findings: list = field(default_factory=list)
    times: dict = field(default_factory=dict)
    step: str = "waiting"


@dataclass
class DoctorReport:
    hosts: list
    findings: list
    recommendation: Optional[dict] = None
    timings: dict = field(default_factory=dict)
    e2e: Optional[dict] = None
    firewall_pairs: dict = field(default_factory=dict)
    interfaces: dict = field(default_factory=dict)  # host -> [{name, up, mtu, addrs}]

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
                "timings": self.timings}


def tree_spawn_pairs(hosts: list[str], radix: int, launcher_in_list: bool = False) -> list[tuple[str, str]]:
    """(parent, child) ssh hops of Open MPI's routing tree (pure).

    mpirun is daemon 0; the hosts get daemons 1..N in order (or 0..N-1 when this host is
    one of them). Daemon v starts v*radix+1 .. v*radix+radix; daemon 0 is this host, whose
    own ssh the ssh check already covers.
    """
    offset = 0 if launcher_in_list else 1
    vpid = {h: i + offset for i, h in enumerate(hosts)}
    by_vpid = {v: h for h, v in vpid.items()}
    pairs = []
    for h, v in vpid.items():
        if v == 0:
            continue
        for c in range(v * radix + 1, v * radix + radix + 1):
            if c in by_vpid:
                pairs.append((h, by_vpid[c]))
    return pairs


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
    from launcher.hosts import resolve_hosts
    from launcher.safe import seconds

    seconds(spec.timeout, "--timeout")
    if spec.e2e_timeout is not None:
        seconds(spec.e2e_timeout, "--e2e-timeout")
    if spec.program and not os.path.exists(spec.program):
        raise UsageError(f"--program {spec.program}: no such file on this host")
    selection = resolve_hosts(spec.host_list, spec.hostfile, spec.cluster, spec.include, spec.exclude)
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
    from checks import ssh
    from checks.probe import start_probe
    from launcher.flavors import detect_flavor, find_mpirun
    from launcher.hosts import is_local
    from launcher.sshconf import job_ssh_files

    t_start = time.monotonic()
    flavor = detect_flavor(find_mpirun())
    cfg_path = ssh.ssh_config_path(spec.ssh_config, selection.ssh_config)
    job_ssh_files(selection, cfg_path, openmpi=True)  # the config the job would get must be expressible: check now
    runs = [HostRun(h.host, h.slots, is_local(h.host)) for h in selection.hosts]
    launcher_in_list = any(r.local for r in runs)
    helper = None if launcher_in_list else HostRun(network.LAUNCHER, 0, True)
    everyone = runs + ([helper] if helper else [])
    probe_timeout = max(3 * spec.timeout, 10.0)
    # The probes only need paths; the local facts are completed from the local probe's answer.
    request = dict(env.local_facts(flavor, None, spec.program).probe_request(), listen=True, gpu=True)
    for r in everyone:
        if r.local:  # starts now, so that it runs while paramiko is imported and the hosts connect
            # Only this host's interfaces and listener are needed when it is not one of the job's hosts.
            own = dict(request, versions=False) if r is not helper else dict(request, versions=False, gpu=False,
                                                                             mpi_load=False)
            r.probe = start_probe(r.name, None, own, spec.timeout)
    if not all(r.local for r in runs):
        config = ssh.load_ssh_config(cfg_path)
        for r, h in zip(runs, selection.hosts):
            if not r.local:
                r.target = ssh.ssh_target(h, config, cfg_path)
    progress.show(runs)

    def phase_a(r: HostRun):
        t0 = time.monotonic()
        try:
            if not r.local:
                r.step = "ssh: connecting"
                r.conn = ssh.connect(r.target, spec.timeout)
                r.times["ssh"] = r.conn.timings["total"]
                r.findings.append(Finding(r.name, "ssh", OK,
                                          f"{r.target.user}@{r.target.where} with {os.path.basename(r.conn.key_label)} "
                                          f"in {r.conn.timings['total']:.2f} s; host key {r.conn.host_key} known"))
                r.step = "probe: running"
                r.probe = start_probe(r.name, r.conn, request, spec.timeout)
            else:
                r.findings.append(Finding(r.name, "ssh", NA, "this host: no SSH needed"))
            t1 = time.monotonic()
            r.report = r.probe.read(probe_timeout, "probe")
            r.times["probe"] = time.monotonic() - t1
            r.step = "probe: done"
        except CheckError as exc:
            check = "ssh" if r.conn is None and not r.local else "env"
            r.findings.append(from_error(check, exc))
            r.step = f"✗ {exc.detail[:60]}"
        r.times["phase_a"] = time.monotonic() - t0

    try:
        workers = max(1, min(MAX_WORKERS, len(everyone)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(phase_a, everyone))
        t_a = time.monotonic()
        findings, rec, fw_pairs, parsed = _analyse(spec, selection, flavor, runs, helper, cfg_path,
                                                   launcher_in_list)
    finally:
        for r in everyone:
            if r.probe:
                r.probe.close()
            if r.conn:
                r.conn.close()
    t_pairs = time.monotonic()
    for r in everyone:
        findings += r.findings
    # --- checks that could not run on a host ---
    for r in runs:
        for check in ("env", "network", "firewall", "gpu"):
            if not any(f.host == r.name and f.check == check for f in findings):
                why = ("no connection to the host" if not r.report else
                       "no subnet shared by all hosts" if rec is None else "no other host to connect to")
                findings.append(Finding(r.name, check, NA, f"not checked: {why}"))
    # --- end to end ---
    e2e_summary = None
    if not spec.e2e:
        findings += [Finding(r.name, "e2e", NA, "skipped (--no-e2e)") for r in runs]
    elif any(f.status == FAIL for f in findings):
        findings += [Finding(r.name, "e2e", NA, "skipped: fix the failures above first") for r in runs]
    else:
        for r in runs:
            r.step = "end to end: running a job through dtrun"
        names = {r.report.get("hostname"): r.name for r in runs if r.report and r.report.get("hostname")}
        cfg_for_job = _job_ssh_config(selection, cfg_path)
        flags = rec.flags(flavor)["dtrun"] if rec else ""
        f2, e2e_summary = e2e_check.end_to_end([r.name for r in runs], cfg_for_job, rec.cidr if rec else None, names,
                                         spec.e2e_timeout or e2e_check.E2E_TIMEOUT_S, flags_text=flags)
        findings += f2
    order = {n: i for i, n in enumerate([r.name for r in everyone])}
    findings.sort(key=lambda f: (order.get(f.host, len(order)), CHECKS.index(f.check) if f.check in CHECKS else 99))
    timings = {
        "total": round(time.monotonic() - t_start, 3),
        "connect_and_probe": round(t_a - t_start, 3),
        "pairs": round(t_pairs - t_a, 3),
        "per_host": {r.name: {k: round(v, 3) for k, v in r.times.items()} for r in everyone},
    }
    hosts = [r.name for r in runs] + ([helper.name] if helper and any(f.host == helper.name for f in findings) else [])
    interfaces = {h: [dataclasses.asdict(i) for i in ifs] for h, ifs in parsed.items()}
    return DoctorReport(hosts, findings, rec.to_dict(flavor) if rec else None, timings, e2e_summary, fw_pairs,
                        interfaces)


def _analyse(spec, selection, flavor, runs, helper, cfg_path, launcher_in_list):
    """After every probe answered: env, network, GPU findings, then the pair round over the live probes."""
    everyone = runs + ([helper] if helper else [])
    findings: list[Finding] = []
    for r in everyone:
        findings += r.findings
        r.findings = []
    local_report = next((r.report for r in everyone if r.local and r.report), None)
    facts = env.local_facts(flavor, local_report, spec.program)
    probed = [r for r in runs if r.report and not r.report.get("error")]
    parsed = {r.name: network.interfaces_of(r.report) for r in everyone if r.report and not r.report.get("error")}
    # --- env ---
    for r in runs:
        if r.report:
            findings += env.env_findings(r.name, r.report, facts, is_this_host=r.local)
    findings += env.consistency_findings({r.name: r.report for r in runs if r.report and not r.local}, facts)
    # --- network (none to choose when every rank runs on this host: MPI uses shared memory) ---
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
    # --- gpu ---
    findings += gpu.gpu_findings([gpu.host_gpus(r.name, r.slots, r.report) for r in probed])
    # --- pairs: firewall and host-to-host ssh ---
    fw_pairs = {}
    if rec is not None:
        fw_pairs = _pairs_phase(spec, runs, helper, rec, ifaces, launcher_ifs, cfg_path, selection, findings,
                                launcher_in_list)
    return findings, rec, fw_pairs, parsed


def _job_ssh_config(selection, cfg_path: Optional[str]) -> Optional[str]:
    """The ssh config mpirun gets: the user's, plus the cluster file's per-host settings."""
    from launcher.sshconf import write_job_config

    return write_job_config(selection, cfg_path)


def _pairs_phase(spec, runs, helper, rec, ifaces, launcher_ifs, cfg_path, selection, findings, launcher_in_list):
    """Second round with every live probe: TCP to every other listener, ssh where the tree needs it."""
    import ipaddress

    from launcher.command import TREE_SPAWN_HOSTS

    net = ipaddress.ip_network(rec.cidr)

    def addr_on(ifs):
        for i in ifs or ():
            for n in i.networks:
                if n.ip in net:
                    return str(n.ip)
        return None

    live = [r for r in runs + ([helper] if helper else []) if r.report and r.report.get("port") and r.probe]
    endpoints = {}
    for r in live:
        a = addr_on(launcher_ifs if r is helper else ifaces.get(r.name))
        if a:
            endpoints[r.name] = (a, r.report["port"])
    plan = firewall.connect_plan(endpoints)
    names = [r.name for r in runs]
    if spec.all_pairs:
        ssh_pairs = [(a, b) for a in names for b in names if a != b]
        why = "--all-pairs"
    else:
        ssh_pairs = tree_spawn_pairs(names, TREE_SPAWN_HOSTS, launcher_in_list)
        why = f"{len(names)} hosts: Open MPI's daemons start each other over ssh (tree spawn, radix {TREE_SPAWN_HOSTS})"
    job_cfg = _job_ssh_config(selection, cfg_path) if ssh_pairs else None
    by_src = {}
    for a, b in ssh_pairs:
        by_src.setdefault(a, []).append([b, b])
    results, ssh_results = {}, {}
    ssh_timeout = spec.timeout

    def phase_c(r):
        req = {"connect": plan.get(r.name, []), "timeout": firewall.CONNECT_TIMEOUT_S,
               "ssh": by_src.get(r.name, []), "ssh_config": job_cfg, "ssh_timeout": ssh_timeout}
        if not req["connect"] and not req["ssh"]:
            return
        r.step = "firewall: connecting"
        t0 = time.monotonic()
        try:
            r.probe.send(req)
            # The probe connects all at once, and runs its ssh hops 32 at a time, each within ssh_timeout + 5 s.
            batches = -(-len(req["ssh"]) // 32)
            wait = firewall.CONNECT_TIMEOUT_S + spec.timeout + batches * (ssh_timeout + 5)
            out = r.probe.read(wait, "firewall probe")
            results[r.name] = out.get("connect", {})
            ssh_results[r.name] = out.get("ssh", {})
            r.step = "firewall: done"
        except CheckError as exc:
            r.findings.append(from_error("firewall", exc))
        r.times["pairs"] = time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=max(1, min(MAX_WORKERS, len(live)))) as pool:
        list(pool.map(phase_c, live))
    if len(endpoints) > 1:
        findings += firewall.firewall_findings(results, endpoints, rec.cidr)
    findings += ssh_pair_findings(ssh_results, why, bool(spec.all_pairs))
    return results


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
    bad = [f for f in report.findings if f.status in (FAIL, WARN)]
    if bad:
        console.print()
    for f in bad:
        print(f"{SYMBOL[f.status]} {f.host} [{f.check}] {f.detail}")
        if f.fix:
            print(f"    fix: {f.fix}")
    rec = report.recommendation
    if rec:
        flags = rec["flags"]
        print(f"\nnetwork: use {rec['cidr']} ({rec['reason']}): dtrun applies {flags['dtrun']} itself; "
              f"mpirun: {flags['mpirun']}; NCCL: {flags['nccl']}")
    if report.e2e and report.e2e.get("stages"):
        stages = ", ".join(f"{s} {t:.2f} s" for s, t in report.e2e["stages"].items())
        print(f"end to end: {stages}")
    n = len([h for h in report.hosts if h != network.LAUNCHER])
    fails = sum(1 for f in report.findings if f.status == FAIL)
    warns = sum(1 for f in report.findings if f.status == WARN)
    verdict = "all checks passed" if not fails and not warns else f"{fails} failed, {warns} warnings"
    print(f"doctor: {n} host{'s' if n != 1 else ''}, {verdict} ({report.timings.get('total', 0):.1f} s)")
