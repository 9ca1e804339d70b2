"""`dtrun top [JOB]`: a live table of a running job, one row per rank (per host beyond
``GROUP_ABOVE`` ranks), refreshed every window; the straggler flagged. The job goes on:
top only reads (launcher/remote/waitsampler.py on every host), and Ctrl-C stops top alone.

``view`` builds the picture (a ``TopView``) from the hosts' latest windows (pure),
``render`` makes the table from it and ``TopView.to_json`` the ``--json`` line;
``show_top`` runs the agents and prints.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from statistics import median
from typing import Callable, Optional, Sequence

from dtrun.launcher.agentreport import HostSample, RankView, SampledFrame
from dtrun.launcher.errors import ExitCode, UsageError
from dtrun.launcher.job import stopsignals
from dtrun.launcher.jobstate import JobInfo, find_job
from dtrun.launcher.stacks import format_ranks
from dtrun.launcher.samplestream import SampleStream
from dtrun.launcher.straggler import (Confirmed, Finding, RankTotals, Recent, find_straggler, frame_text,
                                      render_finding)

GROUP_ABOVE = 16  # more ranks than this: one row per host
SLOWEST_SHOWN = 3  # ranks whose current frame is printed under the table
TOP_RATE_HZ = 20.0
ONCE_S = 3.0  # --once measures this long by default: enough samples to flag a straggler
LIVE_MIN_SAMPLES = 50  # py-spy samples at TOP_RATE_HZ
LIVE_MIN_POLLS = 500  # reads of the recorder's flag (waitsampler.REC_POLL_HZ)


@dataclass(frozen=True, kw_only=True)
class TopSpec:
    job: Optional[str] = None
    once: bool = False
    json_out: bool = False
    interval: Optional[float] = None  # seconds a refresh measures (None: 1, or ONCE_S with --once)
    timeout: float = 5.0  # seconds a host may take to connect


@dataclass(frozen=True)
class HostRow:
    """A host in the table: its answer's age and GPUs, or why it has not answered."""

    host: str
    error: Optional[str] = None
    answered: bool = False
    name: str = ""
    gpus: tuple[dict, ...] = ()
    age_s: Optional[float] = None

    def to_json(self) -> dict:
        if not self.answered:
            return {"host": self.host, "error": self.error}
        return {"host": self.host, "name": self.name, "error": self.error, "gpus": list(self.gpus), "age_s": self.age_s}


@dataclass(frozen=True)
class RankRow:
    """A rank in the table, as its host's latest window measured it."""

    host: str
    rank: int
    pid: Optional[int]
    state: str
    cpu: Optional[float]
    rss: Optional[int]
    rate: Optional[float]  # collectives per second, rounded as shown
    wait: Optional[float]  # share of the window waiting for peers, rounded as shown
    via: str
    gpu_util: Optional[float]
    gpu_mem: Optional[float]
    frame: Optional[SampledFrame]
    error: Optional[str]
    straggler: bool = False

    @classmethod
    def of(cls, v: RankView, straggler: bool) -> "RankRow":
        share = v.wait_share
        return cls(v.host, v.rank, v.pid, v.state, v.cpu, v.rss, None if v.rate is None else round(v.rate, 2),
                   None if share is None else round(share, 3), v.via, v.gpu_util, v.gpu_mem, v.frame,
                   v.error or v.stack_error, straggler)

    def to_json(self) -> dict:
        f = self.frame
        return {"host": self.host, "rank": self.rank, "pid": self.pid, "state": self.state, "cpu": self.cpu,
                "rss": self.rss, "rate": self.rate, "wait": self.wait, "via": self.via,
                "gpu_util": self.gpu_util, "gpu_mem": self.gpu_mem,
                "frame": None if f is None else {"func": f.func, "file": f.file, "line": f.line,
                                                 "waiting": bool(f.waiting)},
                "error": self.error, "straggler": self.straggler}


@dataclass(frozen=True)
class TopView:
    """The job as top shows it: ``render`` makes the table of it, ``to_json`` the --json line."""

    job: str
    np: int
    dtrun_pid: int
    hosts: tuple[HostRow, ...]
    ranks: tuple[RankRow, ...]
    missing: tuple[int, ...]
    straggler: Optional[Finding]

    def to_json(self) -> dict:
        f = self.straggler
        return {"job": self.job, "np": self.np, "dtrun_pid": self.dtrun_pid,
                "hosts": [h.to_json() for h in self.hosts], "ranks": [r.to_json() for r in self.ranks],
                "missing": list(self.missing),
                "straggler": None if f is None else {
                    "ranks": list(f.ranks), "hosts": list(f.hosts), "whole_host": f.whole_host,
                    "others_wait": round(f.others_wait, 3), "own_wait": round(f.own_wait, 3),
                    "frame": None if f.frame is None else dict(zip(("func", "file", "line"), f.frame)),
                    "text": render_finding(f)}}


def _host_row(host: str, s: Optional[HostSample], waited: Optional[float]) -> HostRow:
    if s is None:
        why = "no answer yet" if waited is None else \
            f"no answer within {waited:.0f} s (the host, its sshd or its network is down or silent)"
        return HostRow(host, why)
    return HostRow(host, s.error, True, s.name or host, s.gpus,
                   round(time.monotonic() - s.at, 1) if s.at else None)


def view(job: JobInfo, latest: dict, totals: Sequence[RankTotals], waited: Optional[float] = None,
         confirm: Optional[Callable] = None) -> TopView:
    """The job as top shows it: hosts (with errors), ranks, the straggler (over the windows
    in ``totals``); ``waited``: seconds the hosts that have not answered were given;
    ``confirm``: the live table's ``Confirmed``, which holds a finding back until it lasts."""
    hosts = [_host_row(host, latest.get(host), waited) for host in dict.fromkeys(job.hosts)]
    # At least 2.5 s of samples (or flag reads) per rank: a rank that started late, or was
    # descheduled once on a busy host, is not flagged for one second of it.
    finding = find_straggler(totals, min_samples=LIVE_MIN_SAMPLES, min_polls=LIVE_MIN_POLLS)
    if confirm is not None:
        finding = confirm(finding)
    flagged = set(finding.ranks) if finding else set()
    views = [v for h in hosts if h.answered for v in latest[h.host].ranks]
    rows = sorted((RankRow.of(v, v.rank in flagged) for v in views), key=lambda r: r.rank)
    seen = {r.rank for r in rows}
    return TopView(job.id, job.np, job.dtrun_pid, tuple(hosts), tuple(rows),
                   tuple(r for r in range(job.np) if r not in seen), finding)


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}M"


def _num(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _frame(r: RankRow) -> str:
    f = r.frame
    if not f:
        return r.error or "-"
    return ("in comm: " if f.waiting else "") + frame_text((f.func, f.file, f.line))


def _host_lines(ranks: Sequence[RankRow], gpu: bool) -> list[str]:
    """One row per host: its ranks' medians (memory summed)."""
    by_host: dict = {}
    for r in ranks:
        by_host.setdefault(r.host, []).append(r)
    lines = []
    for host, rs in by_host.items():
        def med(key):
            vals = [getattr(r, key) for r in rs if getattr(r, key) is not None]
            return median(vals) if vals else None
        rss = [r.rss for r in rs if r.rss is not None]
        line = (f"{host[:14]:<14} {format_ranks([r.rank for r in rs]):>5} {len(rs):>5} {_num(med('cpu')):>5} "
                f"{_mib(sum(rss) if rss else None):>7} {_num(med('rate'), '{:.1f}'):>7} {_pct(med('wait')):>5}")
        if gpu:
            line += f" {_num(med('gpu_util')):>5} {_num(med('gpu_mem'), '{:.0f}M'):>7}"
        flagged = [r.rank for r in rs if r.straggler]
        lines.append(line + (f"  ← straggler: rank {format_ranks(flagged)}" if flagged else ""))
    return lines


def _rank_lines(ranks: Sequence[RankRow], gpu: bool) -> list[str]:
    lines = []
    for r in ranks:
        line = (f"{r.host[:14]:<14} {r.rank:>5} {r.state or '-':>5} {_num(r.cpu):>5} "
                f"{_mib(r.rss):>7} "
                f"{_num(r.rate, '{:.1f}'):>7} {_pct(r.wait):>5}")
        if gpu:
            line += f" {_num(r.gpu_util):>5} {_num(r.gpu_mem, '{:.0f}M'):>7}"
        lines.append(line + f"  {r.via or '-'}" + ("  ← straggler" if r.straggler else ""))
    return lines


def render(v: TopView) -> str:
    """The table: a header line, one row per rank (or per host beyond GROUP_ABOVE ranks),
    the hosts that did not answer, and the current frame of the ranks that wait least."""
    ranks = v.ranks
    n = len(v.hosts)
    lines = [f"dtrun top: job {v.job}, {v.np} ranks on {n} host{'s' if n != 1 else ''} "
             f"(dtrun pid {v.dtrun_pid}); "
             f"Ctrl-C leaves the job running"]
    gpu = any(r.gpu_util is not None or r.gpu_mem is not None for r in ranks)
    head = f"{'HOST':<14} {'RANK':>5} {'STATE':>5} {'CPU%':>5} {'RSS':>7} {'COLL/S':>7} {'WAIT':>5}"
    head += f" {'GPU%':>5} {'GPUMEM':>7}" if gpu else ""
    lines.append(head + "  VIA")
    lines += _host_lines(ranks, gpu) if len(ranks) > GROUP_ABOVE else _rank_lines(ranks, gpu)
    for h in v.hosts:
        if h.error:
            lines.append(f"{h.host}: {h.error} — its ranks are not in this table")
    if v.missing and not any(h.error for h in v.hosts):
        lines.append(f"ranks {format_ranks(v.missing)}: no state on any host (not started yet, or already ended)")
    measured = sorted((r for r in ranks if r.wait is not None), key=lambda r: (r.wait, r.rank))
    if measured:
        lines.append("waiting least (the others wait for them):")
        for r in measured[:SLOWEST_SHOWN]:
            lines.append(f"  rank {r.rank} on {r.host}: {_frame(r)}")
    if v.straggler:
        lines.append(render_finding(v.straggler))
    return "\n".join(lines)


def live_table(job: JobInfo, latest: dict, totals: Sequence[RankTotals], confirm: Confirmed) -> str:
    """The table ``dtrun --top`` prints while its job runs (launcher.straggler.StragglerWatch)."""
    return render(view(job, latest, totals, confirm=confirm))


def show_top(spec: TopSpec) -> int:
    """Run the agents on every host of the job, print the table every window (or once)."""
    window = spec.interval if spec.interval is not None else (ONCE_S if spec.once else 1.0)
    if not 1 <= window <= 60:
        raise UsageError(f"--interval {window:g}: give a number of seconds from 1 to 60 "
                         "(py-spy samples whole seconds)")
    if not spec.timeout > 0:
        raise UsageError(f"--timeout {spec.timeout:g}: give a number of seconds above 0")
    job = find_job(spec.job, "top")
    recent = Recent()
    stream = SampleStream(job, window, TOP_RATE_HZ, once=spec.once, connect_timeout=spec.timeout,
                          on_sample=recent.add)
    stream.start()
    tty = sys.stdout.isatty() and not spec.json_out
    try:
        if spec.once:
            t0 = time.monotonic()
            stream.wait_all(t0 + spec.timeout + window + 8)
            v = view(job, stream.latest(), recent.totals(), time.monotonic() - t0)
            print(json.dumps(v.to_json(), indent=1) if spec.json_out else render(v), flush=True)
            return ExitCode.FAILED if any(h.error for h in v.hosts) else ExitCode.OK
        started, confirmed = time.monotonic(), Confirmed()
        while True:
            time.sleep(window)
            latest = stream.latest()
            if not latest and time.monotonic() - started < spec.timeout + window:
                continue
            v = view(job, latest, recent.totals(), time.monotonic() - started, confirmed)
            if spec.json_out:
                print(json.dumps(v.to_json()), flush=True)
            else:
                print(("\x1b[H\x1b[2J" if tty else "\n") + render(v), flush=True)
            if not stream.running():
                return ExitCode.OK  # every host's agent ended with its ranks: the job is over
    except (KeyboardInterrupt, stopsignals.Stopped):
        return ExitCode.INTERRUPTED  # top stops; the job was only read, never signalled
    finally:
        stream.stop()
