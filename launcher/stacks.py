"""Every rank's stack on every host, and the roll-call report that names the odd ones out.

``collect(job)`` runs launcher/remote/agent.py on each host of the job (through ssh, or
directly on this one), all hosts at once, each with a time limit: a host that does not
answer is named in the report, never waited on. ``roll_call(...)`` is pure: it groups the
ranks by where they are (the innermost frame of the user's code; for users of the
collectives runtime, the collective and its sequence number from the flight recorder)
and names the ranks that are not with the others, and ranks whose recorders disagree.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from dtrun.launcher.agentreport import Frame, RankStack, RecEntry, parse_dump
from dtrun.launcher.job.agents import agent_argv
from dtrun.launcher.jobstate import JobInfo
from dtrun.launcher.paths import cache_dir

_RUNTIME_DIR = str(Path(__file__).resolve().parent.parent / "collectives") + os.sep
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/mpi4py/", "<frozen ")
_CALL_RE = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_KEYWORDS = {"if", "elif", "while", "for", "return", "switch", "sizeof", "not", "and", "or", "assert", "print"}
# Operations whose dtype and count must agree on every rank (rooted scatter/gather differ by design).
_SAME_SHAPE_OPS = {"allreduce", "reduce", "broadcast", "allgather", "alltoall", "reduce_scatter"}


@dataclass(frozen=True)
class HostAnswer:
    """One host's answer to ``dump``: its ranks, or why there are none (``error``)."""

    host: str
    ranks: tuple[RankStack, ...] = ()
    error: Optional[str] = None


def load_factor(limit: float = 4.0) -> float:
    """How much slower than idle this host runs a stack reader: its load per core, from 1 to
    ``limit``. gdb needs about 0.25 s of CPU for a rank, yet took over 2.5 s at a load of 3.5
    per core: a fixed limit would call a rank stackless because the machine is busy."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 1.0
    return min(max(per_core, 1.0), limit)


def collect(job: JobInfo, timeout: float = 5.0, via: Optional[str] = None) -> list[HostAnswer]:
    """Ask every host of the job at once; a host gets ``timeout`` (plus the ranks' own limits,
    longer on a loaded machine: ``load_factor``)."""
    hosts = list(dict.fromkeys(job.hosts))
    answers: list[Optional[HostAnswer]] = [None] * len(hosts)
    per_rank = max(1.0, timeout / 2) * load_factor()
    if via is None and os.environ.get("DTRUN_NO_PYSPY", "").strip() == "1":
        via = "faulthandler"  # use the ranks' faulthandler even where py-spy is installed
    extra = (via,) if via else ()

    def ask(i: int, host: str) -> None:
        argv = agent_argv(job, host, "dump", per_rank, extra)
        limit = timeout + per_rank * 2 + 2
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=limit, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            answers[i] = HostAnswer(host, error=f"no answer within {limit:g} s")
            return
        except OSError as exc:
            answers[i] = HostAnswer(host, error=f"cannot run {argv[0]}: {exc.strerror}")
            return
        try:
            ranks = parse_dump(json.loads(p.stdout.strip().splitlines()[-1]), host)
        except (ValueError, IndexError):
            ranks = None
        if ranks is None:
            why = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1][:200]
            answers[i] = HostAnswer(host, error=why)
        else:
            answers[i] = HostAnswer(host, ranks)

    threads = [threading.Thread(target=ask, args=(i, h), daemon=True) for i, h in enumerate(hosts)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + per_rank * 2 + 4
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [a or HostAnswer(h, error="no answer") for a, h in zip(answers, hosts)]


# ------------------------------------------------------------------ pure report

def _is_library(path: str) -> bool:
    return (path.startswith(_RUNTIME_DIR) or any(m in path for m in _LIBRARY_MARKERS)
            or bool(re.search(r"/lib/python3\.\d+/", path)) or path.startswith(("/usr/", "/lib/", "/lib64/"))
            or ".so" in os.path.basename(path)
            or not path.startswith(("/", "<string>")))  # not on this disk: a system library's debug path


def _short(path: str) -> str:
    return os.path.basename(path) if path else "?"


@dataclass(frozen=True)
class Where:
    """Where one rank is: the user's innermost frame, the call on that line, the collective."""

    collective: Optional[str] = None
    user: Optional[Frame] = None
    call: Optional[str] = None


def where(rank: RankStack) -> Where:
    """Where one rank is, from its main thread's stack."""
    t = rank.main_thread
    if t is None:
        return Where()
    coll = inner = user = None
    for fr in t.frames:  # innermost first
        if fr.file.startswith(_RUNTIME_DIR):
            # The outermost runtime frame wins (the public method); py-spy says "Comm._allreduce".
            coll = fr.func.rsplit(".", 1)[-1].lstrip("_")
            continue
        if (_is_library(fr.file) and fr.file != "<string>") or not fr.line:
            inner = fr.func  # the library function the user's line called (native: sleep, MPI_Barrier)
            continue
        user = fr
        break
    if user is None and t.frames:
        user, inner = t.frames[0], None
    code = user.code if user is not None else ""
    calls = [c for c in _CALL_RE.findall(code) if c not in _KEYWORDS]
    call = None
    if inner is not None:
        call = inner.rsplit(".", 1)[-1] if rank.source != "gdb" else inner
    elif calls and not code.startswith(("def ", "class ")):
        call = calls[0]  # a builtin (time.sleep, MPI's Barrier) has no frame of its own
    return Where(coll, user, call)


def describe(rank: RankStack) -> str:
    """The group key: one phrase saying where the rank is (no rank number, no host)."""
    if rank.error and not rank.threads:
        bits = [f"state {rank.state}" if rank.state else "", f"wchan {rank.wchan}" if rank.wchan else ""]
        return ", ".join(b for b in bits if b) + f" (no stack: {rank.error})"
    w = where(rank)
    fr = w.user
    at = f"{_short(fr.file)}:{fr.line} ({fr.func})" if fr and fr.line else \
        (f"{fr.func} ({_short(fr.file)})" if fr else "?")
    head = rank.recorder_head
    if w.collective:
        seq = f" #{head.seq}" if head and head.op == w.collective else ""
        return f"in {w.collective}{seq} at {at}"
    if w.call:
        return f"in {w.call} at {at}"
    return f"at {at}"


def format_ranks(ranks: Sequence[int]) -> str:
    """[0,1,2,3,5,6,7] → '0-3,5-7'."""
    nums = sorted(set(int(r) for r in ranks))
    parts, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(parts)


def _rank_word(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + format_ranks(ranks)


def _signature(h: RecEntry) -> tuple:
    return h.dtype, h.count, h.root


def _shape(dtype: str, count: int, root: Optional[int]) -> str:
    return f"{count} {dtype}" + (f" root {root}" if root is not None else "")


def mismatches(ranks: Sequence[RankStack]) -> list[str]:
    """One line per rank whose flight recorder disagrees with the others' (ranks inside a collective)."""
    heads: dict[int, RecEntry] = {}
    for r in ranks:
        h = r.recorder_head
        if h is not None and (where(r).collective or not r.threads):
            heads[r.rank] = h
    if len(heads) < 2:
        return []
    counts: dict = {}
    for h in heads.values():
        counts[(h.seq, h.op)] = counts.get((h.seq, h.op), 0) + 1
    common = max(counts, key=lambda k: (counts[k], k[0]))
    lines = []
    odd: dict = {}
    for rank, h in sorted(heads.items()):
        if (h.seq, h.op) != common:
            odd.setdefault((h.seq, h.op), []).append(rank)
    for (seq, op), rs in sorted(odd.items(), key=lambda kv: kv[1][0]):
        who = _rank_word(rs) + (" is" if len(rs) == 1 else " are")
        if seq == common[0]:
            lines.append(f"{who} in {op} #{seq}, the others in {common[1]} #{common[0]}")
        else:
            lines.append(f"{who} at #{seq} ({op}), the others at #{common[0]} ({common[1]})")
    if common[1] in _SAME_SHAPE_OPS:
        same = {rank: h for rank, h in heads.items() if (h.seq, h.op) == common}
        lines += _other_arguments(same, common)
    return lines


def _other_arguments(same: dict[int, RecEntry], common: tuple) -> list[str]:
    """The ranks in the common collective with other arguments (dtype, count, root) than most."""
    sig_counts: dict = {}
    for h in same.values():
        sig_counts[_signature(h)] = sig_counts.get(_signature(h), 0) + 1
    if not sig_counts:
        return []
    base = max(sig_counts, key=lambda sig: sig_counts[sig])
    return [f"rank {rank} is in {common[1]} #{common[0]} with {_shape(*_signature(h))}, the others with "
            f"{_shape(*base)}" for rank, h in sorted(same.items()) if _signature(h) != base]


def _group_lines(live: Sequence[RankStack]) -> list[str]:
    """One line per group of ranks in the same place, the largest first; the odd ones marked."""
    groups: dict[str, list[RankStack]] = {}
    for r in live:
        groups.setdefault(describe(r), []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(r.rank for r in kv[1])))
    lines = []
    total = len(live)
    for i, (desc, members) in enumerate(ordered):
        nums = [r.rank for r in members]
        if len(ordered) == 1 or (i == 0 and len(members) > 1):
            lines.append(f"  {_rank_word(nums)} ({len(members)} of {total}) {desc}")
            continue
        hosts = sorted({r.host for r in members})
        pid = f" (pid {members[0].pid})" if len(members) == 1 and not members[0].threads else ""
        lines.append(f"  {_rank_word(nums)} on {','.join(hosts)}{pid} {desc}   ← not with the others")
    return lines


def roll_call(answers: Sequence[HostAnswer], headline: str, expected: Optional[int] = None,
              stacks_file: Optional[str] = None) -> str:
    """The report: one line per group of ranks that are in the same place; odd ones marked."""
    ranks = [r for a in answers for r in a.ranks]
    live = [r for r in ranks if r.alive and (r.threads or r.state)]
    lines = [headline] + _group_lines(live)
    for m in mismatches(live):
        lines.append(f"  mismatch: {m}")
    for r in ranks:
        if r not in live:
            lines.append(f"  rank {r.rank} on {r.host}: {r.error or 'no stack'}")
    for a in answers:
        if a.error:
            lines.append(f"  {a.host}: {a.error} — its ranks are not in this report")
    if expected is not None:
        missing = sorted(set(range(expected)) - {r.rank for r in ranks})
        if missing and not any(a.error for a in answers):
            lines.append(f"  {_rank_word(missing)}: no state on any host (not started yet, or already ended)")
    if stacks_file:
        lines.append(f"  full stacks: {stacks_file}")
    return "\n".join(lines)


def _rank_stacks(r: RankStack) -> list[str]:
    """One rank's part of the full stacks file."""
    out = [f"== rank {r.rank} on {r.host} pid {r.pid} state {r.state if r.state is not None else '?'} "
           f"wchan {r.wchan or '-'} via {r.source or '-'}"]
    if r.error:
        out.append(f"   ({r.error})")
    for t in r.threads:
        out.append(f"  {t.name}{' (main)' if t.main else ''}:")
        for fr in reversed(t.frames):
            out.append(f"    File \"{fr.file}\", line {fr.line}, in {fr.func}")
            if fr.code:
                out.append(f"      {fr.code}")
    if r.recorder:
        out.append("  flight recorder (oldest first):")
        for e in r.recorder:
            root = f" root {e.root}" if e.root is not None else ""
            out.append(f"    #{e.seq} {e.op} {e.count} {e.dtype}{root}")
    return out + [""]


def full_stacks(answers: Sequence[HostAnswer]) -> str:
    """Every thread of every rank, innermost frame last (as Python prints tracebacks)."""
    out = []
    for a in answers:
        if a.error:
            out.append(f"== host {a.host}: {a.error}\n")
        for r in sorted(a.ranks, key=lambda r: r.rank):
            out += _rank_stacks(r)
    return "\n".join(out) + "\n"


def report(job: JobInfo, headline: str, timeout: float = 5.0, out_dir: Optional[str] = None,
           via: Optional[str] = None) -> tuple[str, str, list[HostAnswer]]:
    """Collect, write the whole stacks to a file, return (roll call, file, answers)."""
    answers = collect(job, timeout, via)
    d = Path(out_dir or job.log_dir or (cache_dir() / "hangs"))
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"stacks-{job.id}-{time.strftime('%H%M%S')}-{time.monotonic_ns() % 10**9:09d}.txt"
    text = roll_call(answers, headline, job.np, str(path))
    path.write_text(text + "\n\n" + full_stacks(answers))
    return text, str(path), answers
