"""What Open MPI and MPICH print about a failed job, read back into values.

Used when the rank wrapper's markers do not tell the whole story: a program run without
the wrapper, a rank MPICH's Hydra killed before its wrapper could speak, a daemon lost
with its host, PMIx refusing to start.
"""
from __future__ import annotations

import re
from typing import Optional

from dtrun.launcher.job.result import RankFailure

# Open MPI's own report when no marker was seen (e.g. the program is not wrapped).
_OMPI_RANK_RE = re.compile(r"Process name:\s+\[[^\]]*?,(\d+)\]")
_OMPI_CODE_RE = re.compile(r"Exit code:\s+(\d+)")
_OMPI_SIGNAL_RE = re.compile(r"exited on signal (\d+)")
_OMPI_ABORT_RE = re.compile(r"process rank (\d+) with PID \d+ on node ([^\s\x00-\x1f\x7f]+)")
# The same words start Open MPI's report of a rank killed by a signal (not an abort).
_OMPI_KILLED_RE = re.compile(r"process rank (\d+) with PID \d+ on node ([^\s\x00-\x1f\x7f]+)\s+exited on signal (\d+)")
# MPICH's MPI_Abort report (Hydra kills the wrappers before they can print a marker).
_MPICH_ABORT_RE = re.compile(r"Abort\((\d+)\) on node \d+ \(rank (\d+) in comm \d+\)")
# The words of a stderr line that belongs to one of the reports above.
_REPORT_WORDS = ("Process name:", "Exit code:", "exited on signal", "process rank", "Abort(")
# Open MPI 5 (PRRTE) and 4 (ORTE) when a daemon on another host dies or its connection drops:
# "PRTE has lost communication with a remote daemon. ... Remote daemon: [...] on node h2".
_DAEMON_LOST_RE = re.compile(r"Remote daemon\s*:\s*\[.*?\]\s+on node\s+([^\s\x00-\x1f\x7f]+)")

# What is printed when PMIx 5.0 will not start because a stale session directory holds its
# rendezvous file's name (launcher/remote/sessiondirs.py): mpirun's own refusal on stderr; for
# a remote daemon, only mpirun's report of its exit status 213 (on stdout).
PMIX_LISTENER_FAILED = "PMIx server's listener thread failed to start"
_DAEMON_213_RE = re.compile(r"Remote host:\s+([^\s\x00-\x1f\x7f]+)\s*\n\s*Daemon exit status:\s*213\b")
_DAEMON_255_RE = re.compile(r"Remote host:\s+([^\s\x00-\x1f\x7f]+)\s*\n\s*Daemon exit status:\s*255\b")
PMIX_SCAN_BYTES = 64 << 10


def is_report_line(line: str) -> bool:
    """Whether a stderr line is part of Open MPI's or MPICH's report on a failed rank."""
    return any(word in line for word in _REPORT_WORDS)


def reported_rank(report: str) -> Optional[str]:
    """The rank Open MPI names as the first to fail, if it said."""
    m = _OMPI_RANK_RE.search(report) or _OMPI_ABORT_RE.search(report)
    return m.group(1) if m else None


def killed_rank(report: str) -> Optional[RankFailure]:
    """The rank Open MPI says was killed by a signal ("process rank 1 with PID … on node h2
    exited on signal 9"), if it said: a kill from outside that took the rank's wrapper with it
    leaves no marker, and another rank's abort may come first."""
    killed = _OMPI_KILLED_RE.search(report)
    # what Open MPI "noticed" first, not a kill of its own tear-down
    return RankFailure(killed.group(1), killed.group(2), code=None, signum=int(killed.group(3)),
                       forwarded=False) if killed else None


def fallback_failure(report: str) -> Optional[RankFailure]:
    """The failed rank as the launcher's own report names it (host "?" where it does not)."""
    mpich = _MPICH_ABORT_RE.search(report)
    if mpich:
        code = int(mpich.group(1))  # MPI_Abort's code, or an MPI error code for an internal failure
        return RankFailure(mpich.group(2), "?", code=code if 0 < code < 256 else None)
    rank = _OMPI_RANK_RE.search(report)
    if not rank:
        killed = killed_rank(report)
        if killed:
            return killed
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


def dropped_daemon_host(text: str, started_hosts) -> Optional[str]:
    """The host whose MPI daemon's ssh session ended with exit status 255 after ranks had
    started there. Open MPI 5 reports that (on stdout) as a daemon that "failed to report back
    after being spawned": seen when the daemon was killed, and when its host went down under
    an ssh master connection (launcher/sshmux.py). It had reported back, since its ranks
    ran: it was lost.
    ``started_hosts``: the hosts ranks reported from (their own names; a first label that
    matches will do, as Open MPI may name a host by its full name or not)."""
    started = {h.split(".")[0] for h in started_hosts}
    for host in _DAEMON_255_RE.findall(text):
        if host.split(".")[0] in started:
            return host
    return None


def pmix_refusal(text: str) -> Optional[str]:
    """Where PMIx refused to start, from mpirun's output: the remote host, "this machine", or None."""
    m = _DAEMON_213_RE.search(text)
    if m:
        return m.group(1)
    return "this machine" if PMIX_LISTENER_FAILED in text else None


# --- mpirun's own bytes and dtrun's own lines: no control characters --------------------------

# Control characters that make grep call a text binary or move a terminal's cursor: C0 but tab,
# newline, carriage return (ssh's "\r\n") and ESC (colours), and DEL.
_CONTROL_RE = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1a\x1c-\x1f\x7f]")
_LEADING_CONTROL_RE = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1a\x1c-\x1f\x7f]+")
# In dtrun's own lines, only the newlines that end them.
_OWN_CONTROL_RE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")
# The frame show_help draws around each of Open MPI's messages (74 dashes under PRRTE, 60 for some).
_FRAME_RE = re.compile(rb"-{20,}\r?\n?")
# A rank's line as the launcher tags it: Open MPI's "[1,0]<stderr>: " (4: no space), Hydra's "[0] ".
_RANK_TAG_RE = re.compile(rb"\[\d+,\d+\]<std(?:out|err)>:|\[\d+\] ")


def _escape_byte(m: re.Match) -> bytes:
    return b"" if m.group() == b"\0" else b"\\x%02x" % m.group()[0]


def escape_controls(data: bytes) -> bytes:
    """mpirun's own bytes made safe for a terminal and grep: a NUL dropped (PRRTE writes the
    one that ends its message's C string after it; it says nothing), any other control
    character but tab, CR, LF and ESC shown as ``\\xNN`` (it may mean something: kept visible)."""
    return _CONTROL_RE.sub(_escape_byte, data)


def plain_text(text: str) -> str:
    """One of dtrun's own messages with no control character but its newlines (names in it come
    from mpirun's output and the ranks' markers): NUL dropped, any other shown as ``\\xNN``."""
    return _OWN_CONTROL_RE.sub(lambda m: "" if m.group() == "\0" else f"\\x{ord(m.group()):02x}", text)


class LauncherStderr:
    """Tells mpirun's own stderr lines from its ranks' and passes its own through ``escape_controls``;
    a rank's line passes unchanged (a program may write what it likes).

    Once a start marker came tagged ("[1,0]<stderr>: ", dtrun's default), every untagged line is
    mpirun's own (or its ssh's). Untagged, a rank's line cannot be told from mpirun's, and only what
    surely is mpirun's is changed: the control bytes that begin the line after a show_help frame's
    line (the NUL PRRTE writes after "PRTE has lost communication with a remote daemon").
    """

    def __init__(self) -> None:
        self.tagged = False
        self._after_frame = False

    def saw_start_marker(self, raw: bytes) -> None:
        if _RANK_TAG_RE.match(raw):
            self.tagged = True

    def clean(self, raw: bytes) -> bytes:
        """``raw``, one line of mpirun's stderr (the last may lack its newline), to pass on."""
        after_frame, self._after_frame = self._after_frame, bool(_FRAME_RE.fullmatch(raw))
        lead = _LEADING_CONTROL_RE.match(raw)
        head, rest = (raw[:lead.end()], raw[lead.end():]) if lead else (b"", raw)
        if self.tagged and _RANK_TAG_RE.match(rest):
            return escape_controls(head) + rest  # bytes before a rank's tag are mpirun's
        if self.tagged:
            return escape_controls(raw)
        return escape_controls(head) + rest if after_frame else raw
