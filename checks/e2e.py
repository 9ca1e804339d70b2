"""End to end: a real job through dtrun with the recommended flags, timed stage by stage.

``checks/e2e_job.py`` runs one rank per host and prints a marker at each stage
(started → MPI init → first allreduce → collectives smoke). ``stage_report`` turns
the markers into stage times, or into the stage a hung job stopped at and the
hosts that never reached it; when every rank got that far, ``narrow`` runs the
job on pairs of hosts to find the host or pair that hangs.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Mapping, Optional, Sequence

from dtrun.checks.result import FAIL, OK, Finding

CHECK = "e2e"
JOB = str(Path(__file__).with_name("e2e_job.py"))
MARK = "DTRUN-E2E"
E2E_TIMEOUT_S = 40.0
PAIR_TIMEOUT_S = 15.0
STAGES = ("started", "init", "collective", "smoke")
STAGE_TEXT = {
    "started": "remote daemons up (ssh from this host, daemon start, rank exec)",
    "init": "MPI init (ranks wiring up to each other)",
    "collective": "first collective (allreduce of one integer)",
    "smoke": "collectives smoke (allreduce, broadcast, allgather, alltoall)",
}
STOP_GRACE_S = 12.0  # dtrun forwards SIGTERM to mpirun and escalates to SIGKILL within ~8 s


@dataclass
class JobRun:
    """What one launch printed: marker times per stage per host, its exit code (None: killed on timeout)."""

    hosts: tuple[str, ...]
    t0: float
    returncode: Optional[int] = None
    elapsed: float = 0.0
    seen: dict = field(default_factory=dict)  # stage -> {host: wall time}
    tail: list = field(default_factory=list)  # last lines of output
    no_smoke: str = ""


def job_argv(hosts: Sequence[str], ssh_config: Optional[str], include: Optional[str], smoke: bool = True,
             python: str = sys.executable) -> list[str]:
    """The dtrun command line for one rank per host (pure)."""
    argv = [python, "-m", "launcher", "--no-preflight", "-H", ",".join(f"{h}:1" for h in hosts)]
    if ssh_config:
        argv += ["--ssh-config", ssh_config]
    if include:
        argv += ["--include-iface", include]
    return argv + [python, "-u", JOB] + (["--smoke"] if smoke else [])


def parse_marker(line: str, names: Mapping[str, str]):
    """(stage, host label, time) from a marker line (rank prefixes allowed), or None."""
    i = line.find(MARK + " ")
    if i < 0:
        return None
    parts = line[i:].split()
    if len(parts) >= 5 and parts[1] in STAGES:
        try:
            return parts[1], names.get(parts[2], parts[2]), float(parts[4])
        except ValueError:
            return None
    return None


def run_job(argv: Sequence[str], hosts: Sequence[str], names: Mapping[str, str], timeout: float) -> JobRun:
    """Launch, read markers as they come, and stop the job at ``timeout``."""
    import psutil

    run = JobRun(tuple(hosts), time.time())
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)

    def reader():
        for line in proc.stdout:
            m = parse_marker(line, names)
            if m:
                run.seen.setdefault(m[0], {})[m[1]] = m[2]
            elif MARK + " no-smoke" in line:
                run.no_smoke = line.split("no-smoke", 1)[1].strip()
            run.tail = (run.tail + [line.rstrip()])[-40:]

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        run.returncode = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        family = []
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
        proc.send_signal(signal.SIGTERM)  # dtrun stops mpirun and its ranks the way Ctrl-C does
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for p in family:
            try:
                p.kill()
            except psutil.Error:
                pass
        run.returncode = None
    t.join(2)
    run.elapsed = time.time() - run.t0
    return run


def stage_report(run: JobRun) -> tuple[dict, Optional[str], list]:
    """(seconds per completed stage, the stage it stopped at or None, hosts missing at that stage)."""
    times, prev = {}, run.t0
    for stage in STAGES:
        got = run.seen.get(stage, {})
        missing = [h for h in run.hosts if h not in got]
        if missing:
            if stage == "smoke" and run.returncode == 0:
                break  # smoke not available: not a hang
            return times, stage, missing
        last = max(got.values())
        times[stage] = round(max(0.0, last - prev), 3)
        prev = last
    return times, None, []


def narrow(hosts: Sequence[str], launch, workers: int = 3) -> list[tuple[str, str, Optional[str]]]:
    """Run the job on pairs of hosts; [(a, b, stage it hung at or None)].

    All pairs for up to 5 hosts; beyond that, the first host with each other one.
    """
    if len(hosts) <= 5:
        pairs = list(combinations(hosts, 2))
    else:
        pairs = [(hosts[0], h) for h in hosts[1:]]

    def one(pair):
        run = launch(list(pair))
        _, stage, _ = stage_report(run)
        return pair[0], pair[1], (stage if run.returncode != 0 else None)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, pairs))


def blame(pairs: Sequence[tuple[str, str, Optional[str]]]) -> list[str]:
    """Hosts present in every hanging pair (pure): the likely culprits."""
    bad = [(a, b) for a, b, s in pairs if s]
    if not bad:
        return []
    common = set(bad[0])
    for a, b in bad[1:]:
        common &= {a, b}
    return sorted(common)


def end_to_end(hosts: Sequence[str], ssh_config: Optional[str], include: Optional[str], names: Mapping[str, str],
               timeout: float = E2E_TIMEOUT_S, pair_timeout: float = PAIR_TIMEOUT_S,
               flags_text: str = "") -> tuple[list[Finding], dict]:
    """Launch the staged job on ``hosts``; findings per host and a JSON-ready summary."""
    run = run_job(job_argv(hosts, ssh_config, include), hosts, names, timeout)
    times, stage, missing = stage_report(run)
    summary = {"command": " ".join(job_argv(hosts, ssh_config, include)), "seconds": round(run.elapsed, 2),
               "stages": times, "returncode": run.returncode, "hung_at": stage}
    how = f"with {flags_text}" if flags_text else "with dtrun's default flags"
    if stage is None and run.returncode == 0:
        text = ", ".join(f"{s} {t:.2f} s" for s, t in times.items())
        note = f" (collectives smoke not run: {run.no_smoke})" if run.no_smoke else ""
        return [Finding(h, CHECK, OK, f"job {how} finished in {run.elapsed:.1f} s: {text}{note}") for h in hosts], summary
    if run.returncode not in (None, 0) and stage is None:
        stage = "smoke"
    tail = " | ".join(l for l in run.tail[-3:] if l.strip())
    if run.returncode is not None:
        # It stopped by itself: an error, not a hang.
        detail = (f"the job {how} failed (exit {run.returncode}) at the stage '{STAGE_TEXT[stage]}'"
                  f"{'; no rank on ' + ', '.join(missing) + ' got there' if missing else ''}: {tail[-400:]}")
        findings = [Finding(h, CHECK, FAIL, detail, "see the job's output with: " + summary["command"])
                    for h in (missing or hosts)]
        return findings + [Finding(h, CHECK, OK, "reached every stage before the failure") for h in hosts
                           if missing and h not in missing], summary
    done = f" (done: {', '.join(f'{s} {t:.2f} s' for s, t in times.items())})" if times else ""
    pairs: list = []
    if stage == "started" or len(hosts) < 3:
        culprits = missing  # no pair to try, or ranks that never started name their hosts
    else:
        pairs = narrow(list(hosts), lambda pair: run_job(job_argv(pair, ssh_config, include, smoke=(stage == "smoke")),
                                                         pair, names, pair_timeout))
        summary["pairs"] = [{"hosts": [a, b], "hung_at": s} for a, b, s in pairs]
        culprits = blame(pairs)
    hung_pairs = ", ".join(f"{a}+{b}" for a, b, s in pairs if s)
    if stage == "started":
        where = "its rank never started: the daemon there did not come up or cannot reach this host"
    elif pairs and culprits:
        where = f"every pair of hosts that hangs includes it ({hung_pairs})"
    elif pairs:
        where = (f"pairs that hang: {hung_pairs}; no single host is in all of them" if hung_pairs
                 else f"every pair of hosts works; only all {len(hosts)} together hang")
    else:
        where = "its rank did not get past it"
    findings = []
    for h in hosts:
        if h in culprits or not culprits:
            findings.append(Finding(h, CHECK, FAIL,
                                    f"the job {how} hung at '{STAGE_TEXT[stage]}' for {timeout:g} s{done}: {where}",
                                    _hang_fix(stage)))
        else:
            findings.append(Finding(h, CHECK, OK, f"not implicated in the hang at '{STAGE_TEXT[stage]}'"))
    return findings, summary


def _hang_fix(stage: str) -> str:
    if stage == "started":
        return ("the remote daemon did not start or could not call back: check ssh from this host and TCP back "
                "to this host (doctor's ssh and firewall columns), and the remote PATH")
    if stage == "init":
        return "MPI wire-up hangs when the runtime picks an unreachable address: name the subnet with --include-iface"
    return ("the TCP transport picked an interface that does not lead to the peer (docker0 and the like) or a "
            "firewall drops it: name the shared subnet with --include-iface and open TCP between the hosts")
