"""Reading the rank wrapper's markers out of mpirun's output (their format: launcher.remote.wire).

A start marker and an exit marker arrive on stderr, one line each; the end-of-output
marker is a rank's last stdout line and is cut out of the stream as it passes, also when
it is split across reads or glued to a last line of the program's without a newline.
"""
from __future__ import annotations

import functools
import re
import secrets
from dataclasses import dataclass
from typing import Optional

from dtrun.launcher.job.result import RankFailure
from dtrun.launcher.remote import wire

# A launcher's rank tag before a line: Open MPI's "[1,0]<stdout>: ", Hydra's "[0] ".
_TAG_MAX = 128
_TAG = r"(?:\[[^\]\n]{0,%d}\](?:<stdout>)?:? ?)?" % _TAG_MAX
# Digits a marker's rank may have: a longer run is not a marker, so it is never held back.
_RANK_DIGITS = 10
# What may follow a rank tag's "[...]" before the line itself (Open MPI 5: "<stdout>: ").
_TAG_TAILS = ("<stdout>: ", "<stdout>:", "<stdout> ", "<stdout>", ": ", ":", " ", "")


@dataclass(frozen=True)
class MarkerPatterns:
    """The wrapper's markers for one job's token (launcher/remote/rankexec.py): a line that has a
    marker's text but not this token is the program's own output and passes through."""

    token: str
    exit: re.Pattern
    start: re.Pattern
    eof_line: re.Pattern  # the wrapper's last stdout line, alone (after a rank tag)
    eof_glued: re.Pattern  # ... or after a last line of the program's that had no newline
    eof_head: str  # the end-of-output marker up to its rank number


@functools.lru_cache(maxsize=8)
def marker_patterns(token: str = "") -> MarkerPatterns:
    """The patterns for ``token`` ("": the wrapper ran without one, outside dtrun)."""
    eof_head = wire.eof_head(token)
    return MarkerPatterns(
        token,
        re.compile(wire.exit_regex(token)),
        re.compile(wire.start_regex(token)),
        re.compile(r"(?m)^" + _TAG + re.escape(eof_head) + r"(\d+)\n"),
        re.compile(re.escape(eof_head) + r"(\d+)(?=\n)"),
        eof_head)


def new_marker_token() -> str:
    """A job's marker token: random, so no program can print a marker by chance or by copying."""
    return secrets.token_hex(8)


def parse_marker(line: str, token: str = "") -> Optional[RankFailure]:
    m = marker_patterns(token).exit.search(line)
    if not m:
        return None
    rank, host, kind, value, fwd, when, start_error, program = m.groups()
    forwarded = None if fwd is None else fwd == "1"
    when = float(when) if when else None
    if kind == "signal":
        return RankFailure(rank, host, signum=int(value), forwarded=forwarded, time=when)
    return RankFailure(rank, host, code=int(value), time=when, start_error=start_error,
                       program=(program or "").rstrip() or None)


def parse_start_marker(line: str, token: str = "") -> Optional[tuple[str, str]]:
    m = marker_patterns(token).start.search(line)
    return (m.group(1), m.group(2)) if m else None


def split_eof_markers(text: str, seen: set, token: str = "", line_start: bool = True) -> tuple[str, str]:
    """Remove the wrappers' end-of-output markers from ``text`` (adding their ranks to ``seen``).

    ``line_start``: whether ``text`` begins a line (False when the output passed on so far
    ended without a newline: a marker at the start of ``text`` is then glued to that line,
    whose newline stays).

    Returns the text to pass on and a tail to hold back until more arrives: the end of an
    unfinished last line that could still become a marker (anything else, a prompt or a
    progress bar, goes out at once). The tail is never longer than a rank tag and a marker,
    so a long line without a newline is read once, chunk by chunk, however long it grows.
    """
    pat = marker_patterns(token)
    if pat.eof_head in text:
        def drop(m):
            seen.add(m.group(1))
            return ""

        start = 0 if line_start else text.find("\n") + 1 or len(text)
        text = pat.eof_glued.sub(drop, text[:start]) + pat.eof_glued.sub(drop, pat.eof_line.sub(drop, text[start:]))
    cut = text.rfind("\n") + 1
    hold = _marker_tail(text, cut, pat.eof_head, line_start or cut > 0)
    return text[:hold], text[hold:]


def _marker_tail(text: str, cut: int, head: str, line_start: bool) -> int:
    """Where the part of the last line (from ``cut``) that may still become a marker starts."""
    longest = len(head) + _RANK_DIGITS
    if line_start and text.startswith("[", cut) and len(text) - cut <= longest + _TAG_MAX + 12:
        # a rank tag, whole or in part, maybe with a marker to follow
        close = text.find("]", cut)
        if close == -1:
            return cut
        rest = text[close + 1:]
        if any(t.startswith(rest) or (rest.startswith(t) and _may_become(rest[len(t):], head)) for t in _TAG_TAILS):
            return cut
    # a marker alone, or glued to a last line that had no newline: only the end can be one
    i = text.find(head[0], max(cut, len(text) - longest))
    while i != -1:
        if _may_become(text[i:], head):
            return i
        i = text.find(head[0], i + 1)
    return len(text)


def _may_become(s: str, head: str) -> bool:
    """Whether ``s`` is the start of ``head`` followed by a rank number (without its newline yet)."""
    if len(s) <= len(head):
        return head.startswith(s)
    return s.startswith(head) and len(s) - len(head) <= _RANK_DIGITS and s[len(head):].isdigit()
