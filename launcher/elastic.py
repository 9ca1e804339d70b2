"""Elastic runs: hosts found by ``--host-discovery-script`` join and leave a running job.

horovodrun's flag and format: the script prints the hosts that may run the job now, one
``host:slots`` per line (``host`` alone: one slot). dtrun runs it at the start (the first
attempt's hosts), every ``DISCOVERY_INTERVAL_S`` while an attempt runs, and before each
new attempt. Each run is bounded by ``DISCOVERY_TIMEOUT_S``.

While an attempt runs, a change that matters (a host listed that the job could use while
it has fewer than ``--max-np`` ranks, or a host of the job no longer listed) is posted once
as a notice in the job directory of rank 0's host (``hosts.updated``: a timestamp and
``added`` or ``removed``; through the host agent when that host is another). The job's
next ``state.commit()`` (``hvd.elastic``, collectives/horovod/_elastic.py) sees it on every
rank, and every rank ends with ``RESET_EXIT_CODE`` after that commit. dtrun takes that end
for a reset only when it posted the notice: the next attempt runs on the hosts listed then
and resumes from the commit. Resets do not count against ``--max-restarts``.

Flapping: a host that is lost (it fails the check after a failure, or leaves the list
while the job uses it) may come back once, when the script lists it again and it passes
the check; lost a second time, it stays out for the rest of the run (``FlapRule``).

The pure parts (``parse_discovered``, ``host_change``, ``FlapRule``, ``is_reset``) are
tested by value; ``HostWatch`` is the thread that applies them during an attempt.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

from dtrun.launcher import jobstate
from dtrun.launcher.errors import UsageError
from dtrun.launcher.hostfile import HostSlots, _parse_slots, validate_hostname
from dtrun.launcher.hosts import is_local, merge_duplicates
from dtrun.launcher.job.kill import run_host_agents
from dtrun.launcher.job.observer import JobObserver
from dtrun.launcher.paths import atomic_write
from dtrun.launcher.job.result import root_cause
from dtrun.launcher.safe import MAX_RANKS, count

DISCOVERY_INTERVAL_S = 1.0
DISCOVERY_TIMEOUT_S = 10.0
RESET_EXIT_CODE = 75  # collectives/horovod/_elastic.py's (tests/test_elastic.py holds them equal)
NOTICE = "hosts.updated"
LOST_LIMIT = 2  # a host lost this many times stays out for the rest of the run
RECHECK_S = 5.0  # a listed host that failed the check is checked again after this long
_MAX_OUTPUT = 1 << 20


class DiscoveryError(Exception):
    """The discovery script failed, timed out or printed something that is not a host list."""


def check_script(path: Optional[str]) -> Optional[str]:
    """``--host-discovery-script``: an executable file (before any network step)."""
    if path is None:
        return None
    if not path:
        raise UsageError("--host-discovery-script: give the path of an executable script")
    if not os.path.isfile(path):
        raise UsageError(f"--host-discovery-script {path}: no such file")
    if not os.access(path, os.X_OK):
        raise UsageError(f"--host-discovery-script {path}: not executable (chmod +x {path})")
    return os.path.abspath(path)


def parse_discovered(text: str, source: str) -> list[HostSlots]:
    """The hosts a discovery script printed: ``host:slots`` or ``host`` per line; blank
    lines and ``#`` comments skipped; a host listed twice counts once, with its last slots.

    Raises:
        UsageError: a line that is not a host (named by ``source`` and line number).
    """
    found: dict[str, HostSlots] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.rpartition(":") if ":" in line and not line.endswith("]") else (line, "", "1")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        host = validate_hostname(host, source, n)
        found.pop(host, None)
        found[host] = HostSlots(host, _parse_slots(slots, source, n))
    hosts, _ = merge_duplicates(list(found.values()))
    return hosts


def run_discovery(script: str, environ: Optional[Mapping[str, str]] = None,
                  timeout: float = DISCOVERY_TIMEOUT_S) -> list[HostSlots]:
    """Run the script once and parse what it printed.

    Raises:
        DiscoveryError: it could not run, ran past ``timeout``, exited non-zero or printed
            something else than hosts.
    """
    try:
        p = subprocess.run([script], capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           env=dict(environ) if environ is not None else None)
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"--host-discovery-script {script}: no answer within {timeout:g} s") from None
    except OSError as exc:
        raise DiscoveryError(f"--host-discovery-script {script}: cannot run it ({exc.strerror})") from None
    if p.returncode != 0:
        last = p.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        tail = f": {last[0][:200]}" if last[0] else ""
        raise DiscoveryError(f"--host-discovery-script {script}: exited with code {p.returncode}{tail}")
    try:
        return parse_discovered(p.stdout[:_MAX_OUTPUT].decode("utf-8", "replace"), f"--host-discovery-script {script}")
    except UsageError as exc:
        raise DiscoveryError(str(exc)) from None


@dataclass(frozen=True)
class Change:
    """How the hosts listed now differ from an attempt's, as far as the job is concerned."""

    added: tuple[str, ...] = ()  # hosts the job could grow onto
    removed: tuple[str, ...] = ()  # hosts of the job no longer listed

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)

    def kind(self) -> str:
        return "removed" if self.removed and not self.added else "added"

    def words(self) -> str:
        parts = []
        if self.added:
            parts.append(f"{', '.join(self.added)} listed")
        if self.removed:
            parts.append(f"{', '.join(self.removed)} no longer listed")
        return "; ".join(parts)


def host_change(current: Sequence[str], np: int, listed: Sequence[HostSlots], kept_out: Sequence[str],
                max_np: Optional[int]) -> Change:
    """The change that would make the job move (pure): hosts listed that the job does not
    use, may use (not kept out) and has room for (fewer than ``max_np`` ranks), and hosts it
    uses that are no longer listed."""
    names = {h.host for h in listed}
    room = max_np is None or np < max_np
    added = tuple(h.host for h in listed if h.host not in current and h.host not in kept_out and room)
    removed = tuple(h for h in current if h not in names)
    return Change(added, removed)


class FlapRule:
    """Which lost hosts may come back: each may return once; lost ``LOST_LIMIT`` times, it stays out."""

    def __init__(self, limit: int = LOST_LIMIT):
        self.limit = limit
        self.lost: dict[str, int] = {}

    def record(self, host: str) -> None:
        self.lost[host] = self.lost.get(host, 0) + 1

    def barred(self, host: str) -> bool:
        return self.lost.get(host, 0) >= self.limit

    def why(self, host: str) -> str:
        return f"lost {self.lost.get(host, 0)} times in this run; not taken back"


def is_reset(cause) -> bool:
    """Whether the first failure of an attempt is a rank leaving at a commit for new hosts
    (``root_cause`` of the result: an exit with ``RESET_EXIT_CODE``, no signal)."""
    return cause is not None and cause.signum is None and cause.code == RESET_EXIT_CODE


def notice_text(kind: str, now: Optional[float] = None) -> str:
    return f"{int((time.time() if now is None else now) * 1000)} {kind}\n"


def write_notice(job_dir: str, text: str) -> None:
    """Put the notice in ``job_dir`` (this host's, private), whole or not at all."""
    atomic_write(os.path.join(job_dir, NOTICE), text)


def post_notice(job_dir: str, host: str, kind: str, budget: float = 5.0) -> bool:
    """Post the notice on rank 0's ``host``: directly here, else through its host agent.
    Returns whether it was posted within ``budget`` seconds."""
    text = notice_text(kind)
    if is_local(host):
        try:
            write_notice(job_dir, text)
            return True
        except OSError:
            return False
    job = jobstate.read(job_dir)
    if job is None:
        return False
    answer = run_host_agents(job, "notice", [host], budget, (text.split()[0], kind))[0]
    return bool(answer and answer.get("posted") is True)


class HostWatch(JobObserver):
    """A job observer: runs the discovery script every ``interval`` seconds while the attempt
    runs and posts the first change that matters (``host_change``) to rank 0's host.

    Args:
        listed: runs the script (``run_discovery``), raising DiscoveryError.
        usable: checks the hosts to add (the injected host check): {host: why} of those that fail.
    """

    def __init__(self, job_dir: str, rank0_host: str, current: Sequence[str], np: int, max_np: Optional[int],
                 kept_out: Callable[[], Sequence[str]], listed: Callable[[], list[HostSlots]],
                 usable: Callable[[Sequence[HostSlots]], Mapping[str, str]], interval: float = DISCOVERY_INTERVAL_S):
        self.job_dir, self.rank0_host = job_dir, rank0_host
        self.current, self.np, self.max_np = tuple(current), np, max_np
        self.kept_out, self.listed, self.usable, self.interval = kept_out, listed, usable, interval
        self.posted: Optional[Change] = None
        self.failed_check: dict[str, float] = {}  # hosts to add that failed the check: when (monotonic)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._warned = ""
        self._said_barred: set = set()

    def on_start(self, job) -> None:
        self._thread = threading.Thread(target=self._loop, name="dtrun-discovery", daemon=True)
        self._thread.start()

    def planned_end(self, result) -> bool:
        """Whether the job ended as asked: every rank left at a commit after the notice."""
        return self.posted is not None and is_reset(root_cause(result.failures))

    def on_end(self, result) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=DISCOVERY_TIMEOUT_S + 6)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                hosts = self.listed()
            except DiscoveryError as exc:
                if str(exc) != self._warned:
                    self._warned = str(exc)
                    print(f"dtrun: warning: {exc}; the job goes on with its hosts", file=sys.stderr, flush=True)
                continue
            barred = list(self.kept_out())
            for h in hosts:
                if h.host in barred and h.host not in self._said_barred and h.host not in self.current:
                    self._said_barred.add(h.host)
                    print(f"dtrun: host {h.host} is listed again but was lost {LOST_LIMIT} times in this run; "
                          "not taken back", file=sys.stderr, flush=True)
            now = time.monotonic()
            waiting = [h for h, t in self.failed_check.items() if now - t < RECHECK_S]
            change = host_change(self.current, self.np, hosts, barred + waiting, self.max_np)
            if change.added:
                bad = dict(self.usable([h for h in hosts if h.host in change.added]))
                for h, why in bad.items():
                    if h not in self.failed_check:
                        print(f"dtrun: host {h} is listed by the discovery script but failed the check: {why}; "
                              f"not added (checked again every {RECHECK_S:g} s)", file=sys.stderr, flush=True)
                    self.failed_check[h] = time.monotonic()
                change = Change(tuple(h for h in change.added if h not in bad), change.removed)
            if not change:
                continue
            if self._stop.is_set():
                return
            if post_notice(self.job_dir, self.rank0_host, change.kind()):
                self.posted = change
                print(f"dtrun: hosts changed: {change.words()}; the job moves at its next commit (hvd.elastic "
                      "state.commit)", file=sys.stderr, flush=True)
                return


DEFAULT_RESTARTS = 3  # --max-restarts when --host-discovery-script is given without it


def discovery_options(opts, environ: Optional[Mapping[str, str]] = None):
    """``opts`` with --host-discovery-script's first list of hosts in place of -H, and
    --max-restarts 3 unless given; unchanged without the flag. Checked before any network step.

    Raises:
        UsageError: a bad combination, a script that cannot run or lists no host.
    """
    if opts.host_discovery_script is None:
        if opts.max_np is not None:
            raise UsageError("--max-np is the most ranks a job grows to as --host-discovery-script adds hosts: "
                             "add --host-discovery-script SCRIPT")
        return opts
    script = check_script(opts.host_discovery_script)
    h = opts.hosts
    given = [flag for flag, v in (("-H", h.host_list), ("--hostfile", h.hostfile), ("--cluster", h.cluster)) if v]
    if given:
        raise UsageError(f"--host-discovery-script lists the job's hosts: leave out {given[0]}")
    if opts.spares:
        raise UsageError("--spares: the discovery script lists every host the job may use; list them there")
    max_np = None
    if opts.max_np is not None:
        max_np = count(str(opts.max_np), "--max-np", MAX_RANKS)
        if max_np <= 0:
            raise UsageError(f"--max-np {max_np}: give a positive number of ranks")
    np = opts.np
    if np is not None and max_np is not None and count(str(np), "-np", MAX_RANKS) > max_np:
        raise UsageError(f"-np {np} is more than --max-np {max_np}")
    try:
        listed = run_discovery(script, environ)
    except DiscoveryError as exc:
        raise UsageError(str(exc)) from None
    if not listed:
        raise UsageError(f"--host-discovery-script {script}: listed no host")
    if np is None:
        total = sum(x.slots for x in listed)
        np = str(min(total, max_np) if max_np else total)
    host_list = ",".join(f"[{x.host}]:{x.slots}" if ":" in x.host else f"{x.host}:{x.slots}" for x in listed)
    return replace(opts, hosts=replace(h, host_list=host_list), np=np, max_np=max_np, host_discovery_script=script,
                   max_restarts=opts.max_restarts or DEFAULT_RESTARTS)


def target_np(listed_slots: int, max_np: Optional[int], floor: int) -> int:
    """The ranks of the next attempt of an elastic run (pure): every usable slot, at most
    ``max_np``; fewer than ``floor`` (--min-np, else the first -np) is not enough.

    Raises:
        ValueError: fewer usable slots than ``floor``.
    """
    n = min(listed_slots, max_np) if max_np else listed_slots
    if n < floor:
        raise ValueError(f"{listed_slots} usable slot{'s' if listed_slots != 1 else ''}, fewer than {floor}")
    return n
