"""Every message about a job's end, rendered in one place from the typed records of
``launcher.job.result``: the failure summary (one line and a short table like torchrun's)
and the notes and time-limit sentences the supervisor and the end of an attempt
(launcher/jobend.py) attach to a result.
"""
from __future__ import annotations

import os
import signal
from typing import Optional, Sequence

from dtrun.launcher.errors import ExitCode, signal_name
from dtrun.launcher.job import parsers
from dtrun.launcher.job.result import STOP_GRACE_S, JobResult, RankFailure, root_cause

# Ranks named one by one in a note before "and N more".
_NAMED_MAX = 8


def how_stopped(result: JobResult) -> str:
    if result.forced:
        return (f"{result.launcher} did not stop within {STOP_GRACE_S:g} s, so it and everything it started on this "
                f"host were killed; a host that cannot be reached keeps its ranks until its connections time out")
    return f"{result.launcher} stopped the job on every host"


def launcher_ended(result: JobResult) -> str:
    """How the launcher itself ended: "srun exited with code 137"."""
    if result.mpirun_returncode < 0:
        return f"{result.launcher} was killed by {signal_name(-result.mpirun_returncode)}"
    return f"{result.launcher} exited with code {result.mpirun_returncode}"


def timeout_message(limit: float) -> str:
    return f"the job ran longer than --timeout {limit:g} s"


def not_started_message(expected: Sequence[str], started: dict, limit: float) -> str:
    missing = [r for r in range(len(expected)) if str(r) not in started]
    by_host: dict[str, list[int]] = {}
    for r in missing:
        by_host.setdefault(expected[r], []).append(r)
    parts = []
    for host, ranks in by_host.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{host} ({label} {','.join(map(str, ranks))})")
    return (f"{len(missing)} of {len(expected)} ranks had not started after --start-timeout {limit:g} s; "
            f"not up: {'; '.join(parts)}: check those hosts with `dtrun doctor` (ssh, firewall, a silent network)")


def cut_short_note(missing: Sequence[str], started: dict) -> str:
    """The note for ranks whose last output line never arrived (``supervisor.output_cut_short``)."""
    where = ", ".join(f"rank {r} on {started.get(r, '?')}" for r in missing[:_NAMED_MAX])
    more = f" and {len(missing) - _NAMED_MAX} more" if len(missing) > _NAMED_MAX else ""
    return (f"the end of the output of {where}{more} did not arrive: Open MPI dropped it when the "
            f"job ended (it can when a rank writes a lot just before it exits); --log-dir DIR "
            f"keeps all of it")


def throttled_note(launcher: str, buffer_max: int) -> str:
    return (f"the job wrote output faster than dtrun's stdout took it and more than "
            f"{buffer_max >> 20} MiB waited here; {launcher} may have dropped some of it: "
            f"use --log-dir DIR for large output")


def failure_summary(result: JobResult, log_dir: Optional[str] = None, on_hang: str = "abort") -> str:
    """One summary line and a short table like torchrun's, for a failed job (``on_hang``: the
    --on-hang mode that stopped a hung job). Plain text: the host and program names in it come
    from mpirun's output and the ranks' markers, and no control character of theirs goes out."""
    return parsers.plain_text(_summary_text(result, log_dir, on_hang))


def _summary_text(result: JobResult, log_dir: Optional[str], on_hang: str) -> str:
    lines = [f"dtrun: warning: {n}" for n in result.notes]
    if result.returncode == 0:
        return "\n".join(lines)
    cause = root_cause(result.failures)
    if cause is None:
        headline = _stopped_line(result, on_hang)
        return "\n".join(lines + [headline or f"dtrun: job failed: {_why_no_cause(result)}"])
    headline = _stopped_line(result, on_hang, stdout_closed=False)
    if headline:
        return "\n".join(lines + [headline])
    return "\n".join(lines + _first_failure_table(result, cause, log_dir))


def _stopped_line(result: JobResult, on_hang: str, stdout_closed: bool = True) -> Optional[str]:
    """The one line for a job dtrun stopped (hang, signal, time limit, stdout closed), if it was."""
    if result.hung:
        if on_hang == "restart":
            return "dtrun: the job made no progress and was stopped (--on-hang restart)"
        return f"dtrun: the job made no progress and was stopped (--on-hang abort; exit code {int(ExitCode.HANG)})"
    if result.interrupted:
        return f"dtrun: stopped by {signal_name(result.signum or signal.SIGINT)}; {how_stopped(result)}"
    if result.timeout:
        return f"dtrun: {result.timeout}; the job was stopped (exit {int(ExitCode.TIMEOUT)}): {how_stopped(result)}"
    if stdout_closed and result.stdout_closed:
        return ("dtrun: stdout was closed (the program reading dtrun's output exited, "
                "as with `| head`); the job was stopped")
    return None


def _why_no_cause(result: JobResult) -> str:
    """Why a job failed that no rank's failure explains."""
    why = launcher_ended(result)
    if result.lost_daemon_host:
        return (f"the MPI daemon on {result.lost_daemon_host} died or lost its connection (killed, out of "
                f"memory, or the host or its network went down), so the job was ended; {why}")
    if result.vanished:
        hosts = sorted({h for _, h in result.vanished})
        ranks = ",".join(r for r, _ in result.vanished)
        return (f"rank{'s' if len(result.vanished) > 1 else ''} {ranks} on {', '.join(hosts)} went silent (no exit "
                f"report): the host, its MPI daemon or its network went away; {why}")
    if result.failures:
        stopped = ", ".join(f"rank {f.rank} on {f.host} {f.how}" for f in result.failures[:3])
        why += f" while stopping the job ({stopped})"
    return why


def _first_failure_table(result: JobResult, first: RankFailure, log_dir: Optional[str]) -> list[str]:
    others = len({f.rank for f in result.failures}) - 1
    tail = f" ({others} other rank{'s' if others != 1 else ''} stopped too)" if others > 0 else ""
    head = f"rank {first.rank} on {first.host} {first.how}"
    if first.start_error:  # say it the way a shell would: "PROGRAM: command not found on HOST"
        head = f"{first.program}: {first.start_error} on {first.host} (rank {first.rank})"
    if first.signum is not None:
        how = f"    signal     : {signal_name(first.signum)} ({first.signum})"
    elif first.code is not None:
        how = f"    exit code  : {first.code}"
    else:
        how = "    exit code  : none (MPI aborted the job)"
    lines = [f"dtrun: job failed: {head}{tail}", "  first failure:", f"    rank       : {first.rank}",
             f"    host       : {first.host}", how]
    if log_dir:
        lines.append(f"    log        : {os.path.join(log_dir, f'rank.{first.rank}.log')}")
    return lines


def pmix_refused_note(host: str, removed: int) -> str:
    """The failure summary's note when PMIx would not start on ``host`` and no rank started."""
    return (f"Open MPI's PMIx would not start on {host} and no rank started: the usual cause is "
            "a session directory that a killed job left in that host's temporary directory (ompi.PID, prted.PID) "
            "naming the pid the new mpirun or daemon was given, which PMIx 5.0 does not reclaim. dtrun removes "
            "such directories on this machine at every launch" + (f" ({removed} just now)" if removed else "")
            + " and each host's rank wrapper removes them during every job: run the job again (a new daemon "
            "gets a new pid)")


def tree_spawn_note(hosts: int) -> str:
    """The failure summary's note when mpirun failed silently before any rank under tree spawn."""
    return (f"{hosts} hosts: Open MPI's daemons start each other over ssh (tree spawn), and mpirun "
            "failed before any rank started; a host that cannot ssh to its children fails a launch this way "
            "(Open MPI 5 says nothing about it, 4.1 prints the ssh error with the child's address only): "
            "`dtrun doctor` names the pair, --no-tree-spawn starts every daemon from this host")
