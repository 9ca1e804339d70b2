"""`dtrun top [JOB]`: a live table of a running job, one row per rank (per host beyond
``GROUP_ABOVE`` ranks), refreshed every window; the straggler flagged. The job goes on:
top only reads (launcher/remote/waitsampler.py on every host), and Ctrl-C stops top alone.

``view`` builds the JSON-able picture from the hosts' latest windows (pure), ``render``
makes the table from it; ``show_top`` runs the agents and prints.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from statistics import median
from typing import Callable, Optional, Sequence

from dtrun.launcher.errors import ExitCode, UsageError
from dtrun.launcher.job import stopsignals
from dtrun.launcher.jobstate import JobInfo
from dtrun.launcher.straggler import (Confirmed, HostSample, RankTotals, Recent, SampleStream, find_straggler,
                                frame_text, render_finding)

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


def _row(v) -> dict:
    share = v.wait_share
    return {"host": v.host, "rank": v.rank, "pid": v.pid, "state": v.state, "cpu": v.cpu, "rss": v.rss,
            "rate": None if v.rate is None else round(v.rate, 2),
            "wait": None if share is None else round(share, 3), "via": v.via,
            "gpu_util": v.gpu_util, "gpu_mem": v.gpu_mem,
            "frame": None if v.frame is None else {"func": v.frame[0], "file": v.frame[1], "line": v.frame[2],
                                                   "waiting": bool(v.frame[4])},
            "error": v.error or v.stack_error}


def view(job: JobInfo, latest: dict, totals: Sequence[RankTotals], waited: Optional[float] = None,
         confirm: Optional[Callable] = None) -> dict:
    """The job as top shows it: hosts (with errors), ranks, the straggler (over the windows
    in ``totals``); ``waited``: seconds the hosts that have not answered were given;
    ``confirm``: the live table's ``Confirmed``, which holds a finding back until it lasts."""
    hosts, rows = [], []
    for host in dict.fromkeys(job.hosts):
        s: Optional[HostSample] = latest.get(host)
        if s is None:
            why = "no answer yet" if waited is None else \
                f"no answer within {waited:.0f} s (the host, its sshd or its network is down or silent)"
            hosts.append({"host": host, "error": why})
            continue
        hosts.append({"host": host, "name": s.name or host, "error": s.error, "gpus": s.gpus,
                      "age_s": round(time.monotonic() - s.at, 1) if s.at else None})
        rows += [_row(v) for v in s.ranks]
    rows.sort(key=lambda r: r["rank"])
    # At least 2.5 s of samples (or flag reads) per rank: a rank that started late, or was
    # descheduled once on a busy host, is not flagged for one second of it.
    finding = find_straggler(totals, min_samples=LIVE_MIN_SAMPLES, min_polls=LIVE_MIN_POLLS)
    if confirm is not None:
        finding = confirm(finding)
    flagged = set(finding.ranks) if finding else set()
    for r in rows:
        r["straggler"] = r["rank"] in flagged
    seen = {r["rank"] for r in rows}
    return {"job": job.id, "np": job.np, "dtrun_pid": job.dtrun_pid, "hosts": hosts, "ranks": rows,
            "missing": [r for r in range(job.np) if r not in seen],
            "straggler": None if finding is None else {
                "ranks": list(finding.ranks), "hosts": list(finding.hosts), "whole_host": finding.whole_host,
                "others_wait": round(finding.others_wait, 3), "own_wait": round(finding.own_wait, 3),
                "frame": None if finding.frame is None else dict(zip(("func", "file", "line"), finding.frame)),
                "text": render_finding(finding)}}


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}M"


def _num(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _frame(r) -> str:
    f = r.get("frame")
    if not f:
        return r.get("error") or "-"
    return ("in comm: " if f["waiting"] else "") + frame_text((f["func"], f["file"], f["line"]))


def render(v: dict) -> str:
    """The table: a header line, one row per rank (or per host beyond GROUP_ABOVE ranks),
    the hosts that did not answer, and the current frame of the ranks that wait least."""
    ranks = v["ranks"]
    n = len(v["hosts"])
    lines = [f"dtrun top: job {v['job']}, {v['np']} ranks on {n} host{'s' if n != 1 else ''} "
             f"(dtrun pid {v['dtrun_pid']}); "
             f"Ctrl-C leaves the job running"]
    gpu = any(r["gpu_util"] is not None or r["gpu_mem"] is not None for r in ranks)
    head = f"{'HOST':<14} {'RANK':>5} {'STATE':>5} {'CPU%':>5} {'RSS':>7} {'COLL/S':>7} {'WAIT':>5}"
    head += f" {'GPU%':>5} {'GPUMEM':>7}" if gpu else ""
    lines.append(head + "  VIA")
    if len(ranks) > GROUP_ABOVE:
        from dtrun.launcher.stacks import format_ranks

        by_host: dict = {}
        for r in ranks:
            by_host.setdefault(r["host"], []).append(r)
        for host, rs in by_host.items():
            def med(key):
                vals = [r[key] for r in rs if r[key] is not None]
                return median(vals) if vals else None
            rss = [r["rss"] for r in rs if r["rss"] is not None]
            line = (f"{host[:14]:<14} {format_ranks([r['rank'] for r in rs]):>5} {len(rs):>5} {_num(med('cpu')):>5} "
                    f"{_mib(sum(rss) if rss else None):>7} {_num(med('rate'), '{:.1f}'):>7} {_pct(med('wait')):>5}")
            if gpu:
                line += f" {_num(med('gpu_util')):>5} {_num(med('gpu_mem'), '{:.0f}M'):>7}"
            flagged = [r["rank"] for r in rs if r["straggler"]]
            lines.append(line + (f"  ← straggler: rank {format_ranks(flagged)}" if flagged else ""))
    else:
        for r in ranks:
            line = (f"{r['host'][:14]:<14} {r['rank']:>5} {r['state'] or '-':>5} {_num(r['cpu']):>5} "
                    f"{_mib(r['rss']):>7} "
                    f"{_num(r['rate'], '{:.1f}'):>7} {_pct(r['wait']):>5}")
            if gpu:
                line += f" {_num(r['gpu_util']):>5} {_num(r['gpu_mem'], '{:.0f}M'):>7}"
            lines.append(line + f"  {r['via'] or '-'}" + ("  ← straggler" if r["straggler"] else ""))
    for h in v["hosts"]:
        if h.get("error"):
            lines.append(f"{h['host']}: {h['error']} — its ranks are not in this table")
    if v["missing"] and not any(h.get("error") for h in v["hosts"]):
        from dtrun.launcher.stacks import format_ranks

        lines.append(f"ranks {format_ranks(v['missing'])}: no state on any host (not started yet, or already ended)")
    measured = sorted((r for r in ranks if r["wait"] is not None), key=lambda r: (r["wait"], r["rank"]))
    if measured:
        lines.append("waiting least (the others wait for them):")
        for r in measured[:SLOWEST_SHOWN]:
            lines.append(f"  rank {r['rank']} on {r['host']}: {_frame(r)}")
    if v["straggler"]:
        lines.append(v["straggler"]["text"])
    return "\n".join(lines)


def live_table(job: JobInfo, latest: dict, totals: Sequence[RankTotals], confirm: Confirmed) -> str:
    """The table ``dtrun --top`` prints while its job runs (launcher.straggler.StragglerWatch)."""
    return render(view(job, latest, totals, confirm=confirm))


def show_top(spec: TopSpec) -> int:
    """Run the agents on every host of the job, print the table every window (or once)."""
    from dtrun.launcher.jobstate import find_job

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
            print(json.dumps(v, indent=1) if spec.json_out else render(v), flush=True)
            return ExitCode.FAILED if any(h.get("error") for h in v["hosts"]) else ExitCode.OK
        started, confirmed = time.monotonic(), Confirmed()
        while True:
            time.sleep(window)
            latest = stream.latest()
            if not latest and time.monotonic() - started < spec.timeout + window:
                continue
            v = view(job, latest, recent.totals(), time.monotonic() - started, confirmed)
            if spec.json_out:
                print(json.dumps(v), flush=True)
            else:
                print(("\x1b[H\x1b[2J" if tty else "\n") + render(v), flush=True)
            if not stream.running():
                return ExitCode.OK  # every host's agent ended with its ranks: the job is over
    except (KeyboardInterrupt, stopsignals.Stopped):
        return ExitCode.INTERRUPTED  # top stops; the job was only read, never signalled
    finally:
        stream.stop()
