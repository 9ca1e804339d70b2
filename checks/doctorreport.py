"""The doctor's report: every finding, its JSON, and the table with findings grouped across hosts.

``DoctorReport`` is what ``checks.doctor.diagnose`` returns; ``to_dict`` is ``--json``.
``render`` prints the table (rows hosts, columns checks) and then each finding that is
not ok once, naming every host it holds for (``group_findings``, ``host_names``). It is
apart from the doctor's rounds because it only reads findings: no host, probe or network.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from dtrun.checks.network import LAUNCHER
from dtrun.checks.result import CHECKS, FAIL, NA, OK, SYMBOL, WARN, Finding, worst
from dtrun.launcher.errors import ExitCode


@dataclass
class DoctorReport:
    """Every host's findings (hosts in the table's order), the subnet to use, and what each round measured."""

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
    n = len([h for h in report.hosts if h != LAUNCHER])
    fails = sum(1 for g in bad if g.status == FAIL)
    warns = sum(1 for g in bad if g.status == WARN)
    verdict = "all checks passed" if not fails and not warns else f"{fails} failed, {warns} warnings"
    print(f"doctor: {n} host{'s' if n != 1 else ''}, {verdict} ({report.timings.get('total', 0):.1f} s)")
