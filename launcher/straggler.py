"""The straggler: the rank (or host) that makes the others wait, named at the end of a job.

In synchronous data-parallel work every collective waits for the slowest rank, so the
rank that waits little while the others wait a lot is the one they wait for. Each rank's
waiting is measured by that rank's own host (launcher/remote/waitsampler.py, run on every host
by ``agent.py sample`` over the one ssh connection per host): the time inside
collectives from the bundled runtime's flight recorder, or the share of py-spy (or
faulthandler) samples inside MPI, torch.distributed or NCCL calls. Only shares measured
on each rank's own host are compared, never times across hosts.

``find_straggler`` is pure; ``SampleStream`` (launcher/samplestream.py) runs the agents;
``StragglerWatch`` is the job observer that prints the finding at the end of a multi-rank
job that ran at least ``MIN_RUN_S`` seconds (and, with ``--top``, the live table during it).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Callable, Optional, Sequence

from dtrun.launcher.agentreport import HostSample, RankView, combined_share
from dtrun.launcher.jobstate import JobInfo
from dtrun.launcher.paths import cache_dir
from dtrun.launcher.samplestream import SampleStream
from dtrun.launcher.stacks import format_ranks

MIN_RUN_S = 5.0  # shorter jobs get no finding (too few samples to tell noise from a straggler)
START_DELAY_S = 2.0  # sampling starts this long after every rank started (imports, rendezvous: busy ranks)
WINDOW_S = 2.0
RATE_HZ = 10.0
# A finding needs the others to have waited at least OTHERS_MIN of the run, and the gap
# between them and the named ranks to be at least GAP, at least REL_GAP of what the others
# waited, and at least SPREAD times the others' own scatter (their median absolute
# deviation): on a loaded machine a balanced job's ranks wait a little, in turns, and that
# must not name anyone (6 ranks on 2 cores, looked at for 3 seconds, have shown gaps of 11
# to 16 points between two of them and the rest). Where the collectives themselves are
# slow, the named ranks wait inside them too, and time every rank spends alike (imports,
# start-up) thins all shares, so the named ranks' own share is not required to be small.
OTHERS_MIN = 0.25
GAP = 0.2
REL_GAP = 0.25
SPREAD = 4.0
MIN_SAMPLES = 15
MIN_POLLS = 300  # reads of a recorder's flag: about 1.5 s
DISABLE_VAR = "DTRUN_STRAGGLER"  # =0: no sampling during jobs, no finding


class SteadyState:
    """Which windows count: none until every rank is past its start-up. While one rank
    still imports or sets up, the others wait for it in their first collective; that skew
    is the start, not a straggler. A host's window with start-up samples, until that host
    has had one without, resets what was counted, and windows that overlapped it (arriving
    within one window after it) are left out too. Imports later in the run reset nothing."""

    def __init__(self):
        self._cutoff = 0.0
        self._steady: set = set()  # hosts that have had a window without start-up samples

    def admit(self, sample: HostSample) -> tuple[bool, bool]:
        """(count this sample, forget what was counted before)."""
        if sample.error is not None or not sample.ranks:
            return False, False
        if sample.starting and sample.host not in self._steady:
            self._cutoff = max(self._cutoff, sample.at + sample.window)
            return False, True
        self._steady.add(sample.host)
        return sample.at >= self._cutoff, False


@dataclass
class RankTotals:
    """One rank's figures summed over the windows seen."""

    rank: int
    host: str
    samples: int = 0
    waiting: int = 0
    rec_polls: int = 0  # reads of the recorder's flag (the runtime: the rank marks its time inside collectives)
    rec_inside: int = 0
    frames: dict = field(default_factory=dict)  # (func, file, line, waiting) -> samples
    via: str = ""

    def add(self, v: RankView) -> None:
        self.host = v.host or self.host
        self.samples += v.samples
        self.waiting += v.waiting
        self.rec_polls += v.rec_polls
        self.rec_inside += v.rec_inside
        for f in v.frames:
            key = (f.func, f.file, f.line, f.waiting)
            self.frames[key] = self.frames.get(key, 0) + f.count
        if self.rec_polls:
            self.via = "recorder"
        elif v.samples or not self.via:
            self.via = v.via  # how its samples came (a rank's last window may have none: "proc")

    def share(self, min_samples: int = MIN_SAMPLES, min_polls: int = MIN_POLLS) -> Optional[float]:
        """Share of the measured time spent waiting for peers (None: too little measured)."""
        return combined_share(self.rec_inside / self.rec_polls if self.rec_polls >= min_polls else None,
                              self.waiting / self.samples if self.samples >= min_samples else None)


def accumulate(totals: dict, sample: HostSample) -> None:
    for v in sample.ranks:
        if v.error is None:
            totals.setdefault(v.rank, RankTotals(v.rank, v.host)).add(v)


RECENT_WINDOWS = 5  # the live table flags the straggler of the last few windows, not of the whole run


class Recent:
    """The last RECENT_WINDOWS windows of every host, summed per rank (the live table's view:
    a rank that turns slow is flagged within a few windows, whatever came before)."""

    def __init__(self, windows: int = RECENT_WINDOWS):
        self._windows = windows
        self._by_host: dict[str, deque] = {}
        self._lock = threading.Lock()
        self._steady = SteadyState()

    def add(self, sample: HostSample) -> None:
        with self._lock:
            count, reset = self._steady.admit(sample)
            if reset:
                self._by_host.clear()
            if count:
                self._by_host.setdefault(sample.host, deque(maxlen=self._windows)).append(sample)

    def totals(self) -> list[RankTotals]:
        out: dict = {}
        with self._lock:
            for samples in self._by_host.values():
                for s in samples:
                    accumulate(out, s)
        return list(out.values())


LIVE_CONFIRM = 4  # refreshes in a row that must name the same ranks before the live table flags them


class Confirmed:
    """The live table's decision. It decides at every refresh, so a few seconds in which a
    balanced job's ranks happen to wait unevenly (a loaded host) would name someone sooner
    or later; a finding is shown once ``needed`` refreshes in a row name the same ranks."""

    def __init__(self, needed: int = LIVE_CONFIRM):
        self._needed = needed
        self._ranks: Optional[tuple] = None
        self._count = 0

    def __call__(self, finding: Optional["Finding"]) -> Optional["Finding"]:
        ranks = finding.ranks if finding is not None else None
        if ranks != self._ranks:
            self._ranks, self._count = ranks, 0
        self._count += 1
        return finding if finding is not None and self._count >= self._needed else None


@dataclass(frozen=True)
class Finding:
    ranks: tuple  # the named ranks
    hosts: tuple  # their hosts
    whole_host: bool  # every rank of one host (and only those)
    others_wait: float  # median share the other ranks waited
    own_wait: float  # the most any named rank waited
    frame: Optional[tuple] = None  # (func, file, line) of the named ranks' user code
    measured: int = 0  # ranks measured


def find_straggler(totals: Sequence[RankTotals], min_samples: int = MIN_SAMPLES,
                   min_polls: int = MIN_POLLS) -> Optional[Finding]:
    """The rank, or the host, whose peers waited for it; None when no one stands out.

    The measured ranks are sorted by how much they waited; the named ones are those
    below the widest gap, a minority: one rank, one host's ranks, or a few ranks.
    """
    measured = [(t.share(min_samples, min_polls), t) for t in totals]
    measured = sorted(((s, t) for s, t in measured if s is not None), key=lambda st: (st[0], st[1].rank))
    if len(measured) < 2:
        return None
    shares = [s for s, _ in measured]
    best_k, best_gap = 0, 0.0
    for k in range(1, len(shares) // 2 + 1):
        gap = shares[k] - shares[k - 1]
        if gap > best_gap:
            best_k, best_gap = k, gap
    if not best_k:
        return None
    named, others = measured[:best_k], measured[best_k:]
    own, theirs = max(s for s, _ in named), median(s for s, _ in others)
    mad = median(abs(s - theirs) for s, _ in others)
    if theirs < OTHERS_MIN or best_gap < max(GAP, REL_GAP * theirs, SPREAD * mad):
        return None
    hosts = tuple(sorted({t.host for _, t in named}))
    on_host = [t for _, t in measured if t.host in hosts]
    whole = len(hosts) == 1 and best_k > 1 and len(on_host) == best_k and best_k < len(measured)
    frames: dict = {}
    for _, t in named:
        for key, n in t.frames.items():
            if not key[3]:
                frames[key[:3]] = frames.get(key[:3], 0) + n
    frame = max(frames, key=lambda k: frames[k]) if frames else None
    return Finding(tuple(t.rank for _, t in named), hosts, whole, theirs, own, frame, len(measured))


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def frame_text(frame) -> str:
    func, path, line = frame[:3]
    return f"{func} at {os.path.basename(path)}:{line}"


def render_finding(f: Finding) -> str:
    if f.whole_host:
        who, pron = f"host {f.hosts[0]} (ranks {format_ranks(f.ranks)})", "they"
    elif len(f.ranks) == 1:
        who, pron = f"rank {f.ranks[0]} on {f.hosts[0]}", "it"
    else:
        who, pron = f"ranks {format_ranks(f.ranks)} on {','.join(f.hosts)}", "they"
    text = (f"straggler: {who} made the others wait {_pct(f.others_wait)} of the run "
            f"({pron} waited {_pct(f.own_wait)})")
    if f.frame:
        text += f"; {'its' if pron == 'it' else 'their'} time went to {frame_text(f.frame)}"
    return text


def report_text(finding: Optional[Finding], totals: Sequence[RankTotals], headline: str) -> str:
    """The report file: the finding, then every rank's figures and where its time went."""
    lines = [headline, ""]
    lines.append(f"{'rank':>5} {'host':<16} {'waited':>7} {'measured by':<13} where its samples were")
    for t in sorted(totals, key=lambda t: t.rank):
        s = t.share(1, 1)
        top = sorted(t.frames.items(), key=lambda kv: -kv[1])[:3]
        total = sum(t.frames.values()) or 1
        where = "; ".join(f"{frame_text(k)}{' (waiting)' if k[3] else ''} {n * 100 // total}%" for k, n in top)
        waited = _pct(s) if s is not None else "-"
        lines.append(f"{t.rank:>5} {t.host:<16} {waited:>7} {t.via or '-':<13} {where or '-'}")
    if finding and finding.frame:
        lines += ["", f"the named ranks' user code: {finding.frame[1]}:{finding.frame[2]} in {finding.frame[0]}"]
    return "\n".join(lines) + "\n"


def enabled(environ=os.environ) -> bool:
    return environ.get(DISABLE_VAR, "1").strip() != "0"


class StragglerWatch:
    """A job observer (launcher.job.observer.JobObserver): samples every rank while the job runs,
    prints the finding when it ends; with ``table`` also the live table on stderr:
    ``table(job, latest, totals, confirm)`` is its text (``launcher.top.live_table``)."""

    def __init__(self, job: JobInfo, table: Optional[Callable[..., str]] = None,
                 out: Callable[[str], None] = None, min_run: float = MIN_RUN_S):
        self.job, self.min_run = job, min_run
        self.table, self.top = table, table is not None
        self.out = out or (lambda text: (sys.stderr.write(text + "\n"), sys.stderr.flush()))
        self.totals: dict[int, RankTotals] = {}
        self.recent = Recent()
        self.confirmed = Confirmed()
        self._steady = SteadyState()
        self.finding: Optional[Finding] = None
        self.report_path: Optional[str] = None
        self._lock = threading.Lock()
        self._started: set = set()
        self._t0 = time.monotonic()
        self._stream: Optional[SampleStream] = None
        self._timer: Optional[threading.Timer] = None
        self._stop = threading.Event()
        self._shown = 0.0  # when the live table was last printed (--top)
        self.active = self.top or (job.np >= 2 and enabled())

    def on_start(self, _job) -> None:
        self._t0 = time.monotonic()

    def on_output(self, _stream, _data) -> None:
        pass

    def on_signal(self, _signum) -> bool:
        return False

    def on_rank_exit(self, _failure) -> None:
        pass

    def on_rank_start(self, rank, _host) -> None:
        with self._lock:
            self._started.add(rank)
            if not self.active or len(self._started) != self.job.np or self._timer is not None:
                return
            self._timer = threading.Timer(0 if self.top else START_DELAY_S, self._begin)
            self._timer.daemon = True
            self._timer.start()

    def _begin(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            self._stream = SampleStream(self.job, 1.0 if self.top else WINDOW_S, 20.0 if self.top else RATE_HZ,
                                        on_sample=self._seen)
            self._stream.start()

    def _seen(self, sample: HostSample) -> None:
        with self._lock:
            count, reset = self._steady.admit(sample)
            if reset:
                self.totals.clear()
            if count:
                accumulate(self.totals, sample)
        self.recent.add(sample)
        if self.table is not None and self._stream is not None:
            latest = self._stream.latest()
            now = time.monotonic()
            # once a window (each host's line arrives on its own), when every host has answered
            if all(h in latest for h in self._stream.hosts) and now - self._shown >= 0.8 * self._stream.window:
                self._shown = now
                text = self.table(self.job, latest, self.recent.totals(), self.confirmed)
                self.out(("\x1b[H\x1b[2J" if sys.stderr.isatty() else "") + text)

    def on_end(self, result) -> None:
        with self._lock:
            self._stop.set()
            if self._timer is not None:
                self._timer.cancel()
            stream = self._stream
        if stream is None:
            return
        ran = time.monotonic() - self._t0
        # Only a job that ended well is judged: a failed one has its own report, its ranks
        # ended at different moments, and a lost host's agent would be waited for in vain
        # (seconds before a restart can start).
        worth = (self.job.np >= 2 and enabled() and ran >= self.min_run and getattr(result, "returncode", 0) == 0
                 and not any(getattr(result, k, False) for k in ("interrupted", "hung")))
        if worth:
            stream.wait_ended(2.5)  # the agents print the last window as the ranks end
        stream.stop()
        if not worth:
            return
        with self._lock:
            totals = list(self.totals.values())
        self.finding = find_straggler(totals)
        if self.finding is None:
            return
        line = render_finding(self.finding)
        self.report_path = self._write_report(line, totals)
        self.out(f"dtrun: {line}" + (f"\n  report: {self.report_path}" if self.report_path else ""))

    def _write_report(self, line: str, totals) -> Optional[str]:
        try:
            d = Path(self.job.log_dir or (cache_dir() / "hangs"))
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"straggler-{self.job.id}-{time.strftime('%H%M%S')}.txt"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(report_text(self.finding, totals, f"dtrun: {line}"))
            return str(path)
        except OSError:
            return None
