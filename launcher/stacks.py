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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from dtrun.launcher.job.agents import agent_argv
from dtrun.launcher.jobstate import JobInfo

_RUNTIME_DIR = str(Path(__file__).resolve().parent.parent / "collectives") + os.sep
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/mpi4py/", "<frozen ")
_CALL_RE = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_KEYWORDS = {"if", "elif", "while", "for", "return", "switch", "sizeof", "not", "and", "or", "assert", "print"}
# Operations whose dtype and count must agree on every rank (rooted scatter/gather differ by design).
_SAME_SHAPE_OPS = {"allreduce", "reduce", "broadcast", "allgather", "alltoall", "reduce_scatter"}


@dataclass
class HostAnswer:
    host: str
    ranks: list = field(default_factory=list)
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
            data = json.loads(p.stdout.strip().splitlines()[-1])
            answers[i] = HostAnswer(host, data.get("ranks", []))
        except (ValueError, IndexError):
            why = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1][:200]
            answers[i] = HostAnswer(host, error=why)

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


def _main_thread(rank: dict) -> Optional[dict]:
    threads = rank.get("threads") or []
    for t in threads:
        if t.get("main"):
            return t
    return threads[0] if threads else None


def _short(path: str) -> str:
    return os.path.basename(path) if path else "?"


def where(rank: dict) -> dict:
    """Where one rank is: the user's innermost frame, the call on that line, the collective."""
    t = _main_thread(rank)
    info = {"collective": None, "user": None, "call": None}
    if t is None:
        return info
    frames = t["frames"]
    coll = inner = None
    for fr in frames:  # innermost first
        path = fr.get("file", "")
        if path.startswith(_RUNTIME_DIR):
            # The outermost runtime frame wins (the public method); py-spy says "Comm._allreduce".
            coll = fr["func"].rsplit(".", 1)[-1].lstrip("_")
            continue
        if (_is_library(path) and path != "<string>") or not fr.get("line"):
            inner = fr["func"]  # the library function the user's line called (native: sleep, MPI_Barrier)
            continue
        info["user"] = fr
        break
    if info["user"] is None and frames:
        info["user"] = frames[0]
        inner = None
    info["collective"] = coll
    code = (info["user"] or {}).get("code") or ""
    calls = [c for c in _CALL_RE.findall(code) if c not in _KEYWORDS]
    if inner is not None:
        info["call"] = inner.rsplit(".", 1)[-1] if rank.get("source") != "gdb" else inner
    elif calls and not code.startswith(("def ", "class ")):
        info["call"] = calls[0]  # a builtin (time.sleep, MPI's Barrier) has no frame of its own
    return info


def _head(rank: dict) -> Optional[dict]:
    rec = rank.get("recorder") or []
    return rec[-1] if rec else None


def describe(rank: dict) -> str:
    """The group key: one phrase saying where the rank is (no rank number, no host)."""
    if rank.get("error") and not rank.get("threads"):
        state = rank.get("state", "")
        bits = [f"state {state}" if state else "", f"wchan {rank['wchan']}" if rank.get("wchan") else ""]
        return ", ".join(b for b in bits if b) + f" (no stack: {rank['error']})"
    w = where(rank)
    fr = w["user"]
    at = f"{_short(fr['file'])}:{fr['line']} ({fr['func']})" if fr and fr.get("line") else \
        (f"{fr['func']} ({_short(fr['file'])})" if fr else "?")
    head = _head(rank)
    if w["collective"]:
        seq = f" #{head['seq']}" if head and head["op"] == w["collective"] else ""
        return f"in {w['collective']}{seq} at {at}"
    if w["call"]:
        return f"in {w['call']} at {at}"
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


def mismatches(ranks: Sequence[dict]) -> list[str]:
    """One line per rank whose flight recorder disagrees with the others' (ranks inside a collective)."""
    heads = {}
    for r in ranks:
        h = _head(r)
        w = where(r)
        if h is not None and (w["collective"] or not r.get("threads")):
            heads[int(r["rank"])] = h
    if len(heads) < 2:
        return []
    def key(h):
        return (h["seq"], h["op"])
    counts: dict = {}
    for h in heads.values():
        counts[key(h)] = counts.get(key(h), 0) + 1
    common = max(counts, key=lambda k: (counts[k], k[0]))
    lines = []
    odd: dict = {}
    for rank, h in sorted(heads.items()):
        if key(h) != common:
            odd.setdefault(key(h), []).append(rank)
    for (seq, op), rs in sorted(odd.items(), key=lambda kv: kv[1][0]):
        who = _rank_word(rs) + (" is" if len(rs) == 1 else " are")
        if seq == common[0]:
            lines.append(f"{who} in {op} #{seq}, the others in {common[1]} #{common[0]}")
        else:
            lines.append(f"{who} at #{seq} ({op}), the others at #{common[0]} ({common[1]})")
    # Same operation and sequence, different arguments.
    ref = [h for h in heads.values() if key(h) == common]
    if ref and common[1] in _SAME_SHAPE_OPS:
        sig_counts: dict = {}
        for h in ref:
            s = (h["dtype"], h["count"], h["root"])
            sig_counts[s] = sig_counts.get(s, 0) + 1
        base = max(sig_counts, key=lambda s: sig_counts[s])
        for rank, h in sorted(heads.items()):
            if key(h) == common and (h["dtype"], h["count"], h["root"]) != base:
                what = f"{h['count']} {h['dtype']}" + (f" root {h['root']}" if h["root"] is not None else "")
                other = f"{base[1]} {base[0]}" + (f" root {base[2]}" if base[2] is not None else "")
                lines.append(f"rank {rank} is in {common[1]} #{common[0]} with {what}, the others with {other}")
    return lines


def roll_call(answers: Sequence[HostAnswer], headline: str, expected: Optional[int] = None,
              stacks_file: Optional[str] = None) -> str:
    """The report: one line per group of ranks that are in the same place; odd ones marked."""
    ranks = [r for a in answers for r in a.ranks]
    live = [r for r in ranks if r.get("alive", True) and (r.get("threads") or r.get("state"))]
    groups: dict[str, list[dict]] = {}
    for r in live:
        groups.setdefault(describe(r), []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(int(r["rank"]) for r in kv[1])))
    lines = [headline]
    total = len(live)
    for i, (desc, members) in enumerate(ordered):
        nums = [int(r["rank"]) for r in members]
        if i == 0 and len(ordered) > 1 and len(members) > 1:
            lines.append(f"  {_rank_word(nums)} ({len(members)} of {total}) {desc}")
            continue
        hosts = sorted({r["host"] for r in members})
        pid = f" (pid {members[0]['pid']})" if len(members) == 1 and not members[0].get("threads") else ""
        line = f"  {_rank_word(nums)} on {','.join(hosts)}{pid} {desc}"
        if len(ordered) == 1:
            line = f"  {_rank_word(nums)} ({len(members)} of {total}) {desc}"
        elif i > 0 or len(members) == 1:
            line += "   ← not with the others"
        lines.append(line)
    for m in mismatches(live):
        lines.append(f"  mismatch: {m}")
    for r in ranks:
        if r not in live:
            lines.append(f"  rank {r.get('rank')} on {r.get('host')}: {r.get('error') or 'no stack'}")
    for a in answers:
        if a.error:
            lines.append(f"  {a.host}: {a.error} — its ranks are not in this report")
    if expected is not None:
        seen = {int(r["rank"]) for r in ranks}
        missing = sorted(set(range(expected)) - seen)
        if missing and not any(a.error for a in answers):
            lines.append(f"  {_rank_word(missing)}: no state on any host (not started yet, or already ended)")
    if stacks_file:
        lines.append(f"  full stacks: {stacks_file}")
    return "\n".join(lines)


def full_stacks(answers: Sequence[HostAnswer]) -> str:
    """Every thread of every rank, innermost frame last (as Python prints tracebacks)."""
    out = []
    for a in answers:
        if a.error:
            out.append(f"== host {a.host}: {a.error}\n")
        for r in sorted(a.ranks, key=lambda r: int(r["rank"])):
            out.append(f"== rank {r['rank']} on {r['host']} pid {r.get('pid')} state {r.get('state', '?')} "
                       f"wchan {r.get('wchan') or '-'} via {r.get('source') or '-'}")
            if r.get("error"):
                out.append(f"   ({r['error']})")
            for t in r.get("threads") or []:
                out.append(f"  {t['name']}{' (main)' if t.get('main') else ''}:")
                for fr in reversed(t["frames"]):
                    out.append(f"    File \"{fr['file']}\", line {fr['line']}, in {fr['func']}")
                    if fr.get("code"):
                        out.append(f"      {fr['code']}")
            if r.get("recorder"):
                out.append("  flight recorder (oldest first):")
                for e in r["recorder"]:
                    root = f" root {e['root']}" if e.get("root") is not None else ""
                    out.append(f"    #{e['seq']} {e['op']} {e['count']} {e['dtype']}{root}")
            out.append("")
    return "\n".join(out) + "\n"


def report(job: JobInfo, headline: str, timeout: float = 5.0, out_dir: Optional[str] = None,
           via: Optional[str] = None) -> tuple[str, str, list[HostAnswer]]:
    """Collect, write the whole stacks to a file, return (roll call, file, answers)."""
    from dtrun.launcher.paths import cache_dir

    answers = collect(job, timeout, via)
    d = Path(out_dir or job.log_dir or (cache_dir() / "hangs"))
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"stacks-{job.id}-{time.strftime('%H%M%S')}-{time.monotonic_ns() % 10**9:09d}.txt"
    text = roll_call(answers, headline, job.np, str(path))
    path.write_text(text + "\n\n" + full_stacks(answers))
    return text, str(path), answers
