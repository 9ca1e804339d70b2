"""``dtrun doctor``: the checklist users go through when mpirun hangs, on every host at once.

Per host, in a bounded thread pool: one SSH connection (``checks/ssh.py``), one run
of the probe over it (``launcher/remote/probe.py``, started by ``checks/probesession.py``),
which reports the environment and interfaces and keeps a TCP listener open; then, once
every probe has answered, each probe connects to every other host's listener (firewall)
and, where Open MPI's tree spawn or ``--all-pairs`` needs it, ssh-es to other hosts
(``checks/crosshost.py``). This host takes part too, since mpirun runs here. Then, when
nothing failed, a real job through dtrun with the recommended flags (``checks/e2e.py``).
A dead host costs its connect timeout and never holds up the others. This module runs
the rounds in order and reads the first round's answers together; the report and its
table are ``checks/doctorreport.py``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from dtrun.checks import e2e as e2e_check
from dtrun.checks import env, gpu, network
from dtrun.checks.crosshost import links_round, pairs_round
from dtrun.checks.doctorhosts import MAX_WORKERS, DoctorHosts, HostRun, Progress
from dtrun.checks.doctorreport import DoctorReport, render
from dtrun.checks.errors import CheckError
from dtrun.checks.fanout import fan_out
from dtrun.checks.probereport import probe_report
from dtrun.checks.probesession import start_probe
from dtrun.checks.result import CHECKS, FAIL, NA, OK, Finding
from dtrun.checks.ssh import connect
from dtrun.checks.sshlib import import_paramiko
from dtrun.checks.sshtarget import load_ssh_config, ssh_config_path, ssh_target
from dtrun.launcher.errors import UsageError
from dtrun.launcher.flavors import detect_flavor, find_mpirun
from dtrun.launcher.hosts import HostOptions, is_local, resolve_hosts
from dtrun.launcher.safe import seconds
from dtrun.launcher.sshconf import job_ssh_files, write_job_config


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


def run_doctor(spec: DoctorSpec) -> int:
    """Resolve the hosts, run every check, print the table (or JSON); return the exit code."""
    # paramiko's import (~60 ms) goes on while the hosts are resolved and this host's probe starts.
    threading.Thread(target=import_paramiko, name="import-paramiko", daemon=True).start()
    seconds(spec.timeout, "--timeout")
    if spec.e2e_timeout is not None:
        seconds(spec.e2e_timeout, "--e2e-timeout")
    if spec.program and not os.path.exists(spec.program):
        raise UsageError(f"--program {spec.program}: no such file on this host")
    selection = resolve_hosts(spec.hosts)
    report = diagnose(spec, selection, live=not spec.json and sys.stderr.isatty())
    if spec.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render(report)
    return report.exit_code


def links_sample(text: Optional[str], links: bool) -> Optional[int]:
    """``--links-sample`` as a number of pairs (None: the default).

    Raises:
        UsageError: not a whole number from 0 to 4096, or given without ``--links``.
    """
    if text is None:
        return None
    if not text.strip().isdigit() or int(text) > 4096:
        raise UsageError(f"--links-sample {text!r}: expected a whole number of pairs from 0 to 4096")
    if not links:
        raise UsageError("--links-sample needs --links")
    return int(text)


def diagnose(spec: DoctorSpec, selection, live: bool = False) -> DoctorReport:
    """Every check on every host of ``selection``; the report with one or more findings per host and check."""
    progress = Progress(live)
    try:
        return _diagnose(spec, selection, progress)
    finally:
        progress.stop()


def _diagnose(spec: DoctorSpec, selection, progress: Progress) -> DoctorReport:
    """The rounds in order: connect and probe, read the answers together, host to host, end to end."""
    t_start = time.monotonic()
    flavor, cfg_path, hosts, request = _prepare(spec, selection)
    job_cfg = lambda: _job_ssh_config(selection, cfg_path)  # noqa: E731  (written only if needed)
    progress.show(hosts.runs)
    try:
        findings = _first_round(spec, hosts, request)
        t_probed = time.monotonic()
        analysis = _analyse(spec, flavor, hosts)
        findings += analysis.findings
        found, fw_pairs, links_summary, t_links_start = _between_hosts(spec, hosts, analysis, job_cfg)
        findings += found
    finally:
        _close(hosts.everyone)
    t_links_done = time.monotonic()  # the links round (or, without one, the firewall round) has ended
    if links_summary is None:
        t_links_start = t_links_done
    rec = analysis.recommendation
    findings += _not_checked(hosts.runs, findings, rec)
    found, e2e_summary = _end_to_end(spec, hosts.runs, findings, flavor, rec, job_cfg)
    findings += found
    order = hosts.order()
    findings.sort(key=lambda f: (order.get(f.host, len(order)), CHECKS.index(f.check) if f.check in CHECKS else 99))
    timings = {
        "total": round(time.monotonic() - t_start, 3),
        "connect_and_probe": round(t_probed - t_start, 3),
        "pairs": round(t_links_start - t_probed, 3),
        "links": round(t_links_done - t_links_start, 3),
        "per_host": {r.name: {k: round(v, 3) for k, v in r.times.items()} for r in hosts.everyone},
    }
    helper = hosts.helper
    helper_found = helper is not None and any(f.host == helper.name for f in findings)
    names = [r.name for r in hosts.runs] + ([helper.name] if helper_found else [])
    interfaces = {h: [dataclasses.asdict(i) for i in ifs] for h, ifs in analysis.interfaces.items()}
    return DoctorReport(names, findings, rec.to_dict(flavor) if rec else None, timings, e2e_summary, fw_pairs,
                        interfaces, links_summary)


def _first_round(spec: DoctorSpec, hosts: DoctorHosts, request: dict) -> list[Finding]:
    """Connect and probe every host at once; the ssh findings, and a finding for each host that failed."""
    answers = fan_out(hosts.everyone, lambda r: _connect_and_probe(spec, r, request), MAX_WORKERS)
    findings = [f for found in answers.ok.values() for f in found]
    by_name = {r.name: r for r in hosts.everyone}  # no connection yet: ssh failed; else the probe did
    return findings + answers.findings(lambda name: "env" if by_name[name].conn or by_name[name].local else "ssh")


def _between_hosts(spec: DoctorSpec, hosts: DoctorHosts, analysis: Analysis, job_cfg):
    """The firewall and ssh-hop round, then --links; (findings, firewall pairs, links summary, links start).

    Both need the subnet to use: without one, neither runs.
    """
    rec, findings, fw_pairs, links_summary = analysis.recommendation, [], {}, None
    if rec is not None:
        findings, fw_pairs = pairs_round(hosts, rec, analysis.placed, analysis.launcher_interfaces, job_cfg,
                                         timeout=spec.timeout, all_pairs=spec.all_pairs)
    t_links_start = time.monotonic()
    if spec.links and rec is not None:
        found, links_summary = links_round(hosts, rec, analysis.placed, timeout=spec.timeout,
                                           sample=spec.links_sample)
        findings += found
    return findings, fw_pairs, links_summary, t_links_start


def _close(runs: list[HostRun]) -> None:
    """End every probe and close every connection (each host's, whatever round it reached)."""
    for r in runs:
        if r.probe:
            r.probe.close()
        if r.conn:
            r.conn.close()


def _prepare(spec: DoctorSpec, selection):
    """The MPI flavor, the ssh config, the hosts (local probes already started) and the probe request."""
    flavor = detect_flavor(find_mpirun())
    cfg_path = ssh_config_path(spec.hosts.ssh_config, selection.ssh_config)
    job_ssh_files(selection, cfg_path, openmpi=True)  # the config the job would get must be expressible: check now
    runs = [HostRun(h.host, h.slots, is_local(h.host)) for h in selection.hosts]
    hosts = DoctorHosts(runs, None if any(r.local for r in runs) else HostRun(network.LAUNCHER, 0, True))
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
        config = load_ssh_config(cfg_path)
        for r, h in zip(runs, selection.hosts):
            if not r.local:
                r.target = ssh_target(h, config, cfg_path)
    return flavor, cfg_path, hosts, request


def _connect_and_probe(spec: DoctorSpec, r: HostRun, request: dict) -> list[Finding]:
    """First round, one host: ssh (unless local), start the probe, read its report.

    Raises:
        CheckError: the host cannot be reached or its probe did not answer.
    """
    t0 = time.monotonic()
    try:
        if r.local:
            found = [Finding(r.name, "ssh", NA, "this host: no SSH needed")]
        else:
            r.step = "ssh: connecting"
            r.conn = connect(r.target, spec.timeout)
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


def _analyse(spec: DoctorSpec, flavor, hosts: DoctorHosts) -> Analysis:
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
    return write_job_config(selection, cfg_path)
