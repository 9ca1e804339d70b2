"""What Open MPI and MPICH print about a failed job, read back into values.

Used when the rank wrapper's markers do not tell the whole story: a program run without
the wrapper, a rank MPICH's Hydra killed before its wrapper could speak, a daemon lost
with its host, PMIx refusing to start.
"""
from __future__ import annotations

import re
from typing import Optional

from launcher.job.result import RankFailure

# Open MPI's own report when no marker was seen (e.g. the program is not wrapped).
_OMPI_RANK_RE = re.compile(r"Process name:\s+\[[^\]]*?,(\d+)\]")
_OMPI_CODE_RE = re.compile(r"Exit code:\s+(\d+)")
_OMPI_SIGNAL_RE = re.compile(r"exited on signal (\d+)")
_OMPI_ABORT_RE = re.compile(r"process rank (\d+) with PID \d+ on node (\S+)")
# MPICH's MPI_Abort report (Hydra kills the wrappers before they can print a marker).
_MPICH_ABORT_RE = re.compile(r"Abort\((\d+)\) on node \d+ \(rank (\d+) in comm \d+\)")
# The words of a stderr line that belongs to one of the reports above.
_REPORT_WORDS = ("Process name:", "Exit code:", "exited on signal", "process rank", "Abort(")
# Open MPI 5 (PRRTE) and 4 (ORTE) when a daemon on another host dies or its connection drops:
# "PRTE has lost communication with a remote daemon. ... Remote daemon: [...] on node h2".
_DAEMON_LOST_RE = re.compile(r"Remote daemon\s*:\s*\[.*?\]\s+on node\s+(\S+)")

# What is printed when PMIx 5.0 will not start because a stale session directory holds its
# rendezvous file's name (launcher/remote/sessiondirs.py): mpirun's own refusal on stderr; for
# a remote daemon, only mpirun's report of its exit status 213 (on stdout).
PMIX_LISTENER_FAILED = "PMIx server's listener thread failed to start"
_DAEMON_213_RE = re.compile(r"Remote host:\s+(\S+)\s*\n\s*Daemon exit status:\s*213\b")
PMIX_SCAN_BYTES = 64 << 10


def is_report_line(line: str) -> bool:
    """Whether a stderr line is part of Open MPI's or MPICH's report on a failed rank."""
    return any(word in line for word in _REPORT_WORDS)


def reported_rank(report: str) -> Optional[str]:
    """The rank Open MPI names as the first to fail, if it said."""
    m = _OMPI_RANK_RE.search(report) or _OMPI_ABORT_RE.search(report)
    return m.group(1) if m else None


def fallback_failure(report: str) -> Optional[RankFailure]:
    """The failed rank as the launcher's own report names it (host "?" where it does not)."""
    mpich = _MPICH_ABORT_RE.search(report)
    if mpich:
        code = int(mpich.group(1))  # MPI_Abort's code, or an MPI error code for an internal failure
        return RankFailure(mpich.group(2), "?", code=code if 0 < code < 256 else None)
    rank = _OMPI_RANK_RE.search(report)
    if not rank:
        abort = _OMPI_ABORT_RE.search(report)
        return RankFailure(abort.group(1), abort.group(2), code=None) if abort else None
    code = _OMPI_CODE_RE.search(report)
    sig = _OMPI_SIGNAL_RE.search(report)
    return RankFailure(rank.group(1), "?", code=int(code.group(1)) if code else None,
                       signum=int(sig.group(1)) if sig else None)


def lost_daemon_host(stderr_text: str) -> Optional[str]:
    """The host whose MPI daemon Open MPI says it lost, if it said."""
    hosts = _DAEMON_LOST_RE.findall(stderr_text)
    return hosts[0] if hosts else None


def pmix_refusal(text: str) -> Optional[str]:
    """Where PMIx refused to start, from mpirun's output: the remote host, "this machine", or None."""
    m = _DAEMON_213_RE.search(text)
    if m:
        return m.group(1)
    return "this machine" if PMIX_LISTENER_FAILED in text else None
