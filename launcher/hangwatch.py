"""Watching a running job: the stack report on SIGQUIT, and on no progress for S seconds.

Progress is a collective of the bundled runtime started on any rank (the flight
recorders' sequence numbers, read on each host by a ``agent.py watch`` process);
for a job that does not use the runtime, output: lines dtrun relays from any rank, or
growth of a rank's log under --log-dir. The clock starts when every rank has started.
When nothing progressed for ``hang_timeout`` seconds the watch prints the roll-call
report (launcher/stacks.py) once, and again only after progress resumed and stalled anew.
``on_hang="abort"`` then stops the job, and dtrun exits with ExitCode.HANG.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from dtrun.launcher.agentreport import parse_watch
from dtrun.launcher.hosts import is_local
from dtrun.launcher.job.agents import agent_argv
from dtrun.launcher.job.kill import pmix_namespace, reap_remote_daemons, tidy_remote_hosts
from dtrun.launcher.job.result import StopReason
from dtrun.launcher.jobstate import JobInfo
from dtrun.launcher.stacks import report

ON_HANG = ("report", "abort", "restart")  # restart: stop as abort does, then --max-restarts (launcher/restarts.py)


class HangWatch:
    """A job observer, one per job: SIGQUIT → report; with ``hang_timeout`` also the watchdog.
    After a job that ended by itself it ends the daemons or tidies the files left on the other hosts."""

    def __init__(self, job: JobInfo, hang_timeout: Optional[float] = None, on_hang: str = "report",
                 stacks_timeout: float = 5.0, out: Callable[[str], None] = None, reap_daemons: bool = False,
                 cleanup_follows: bool = False):
        self.job = job
        self.reap_daemons = reap_daemons  # Open MPI 5 over ssh: end its stuck daemons after every job
        # The run stops what is left of a failed job on every host itself (its kill round, which
        # tidies too: launcher/run.py), so a failed job needs no reap or tidy from here.
        self.cleanup_follows = cleanup_follows
        self.hang_timeout = hang_timeout
        self.on_hang = on_hang
        self.nspace = ""  # the job's Open MPI 5 PMIx namespace, once it runs (on_start)
        self.stacks_timeout = stacks_timeout
        self.out = out or (lambda text: (sys.stderr.write(text + "\n"), sys.stderr.flush()))
        self._abort: Optional[Callable[[], None]] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._dump = threading.Event()
        self._dump_reason = ""
        self._last_output = time.monotonic()
        self._last_rec = time.monotonic()
        self._last_log = time.monotonic()
        self._runtime = False
        self._seen: dict[str, list] = {}
        self._started: set = set()
        self._agents: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []

    # -- called from run_job
    def saw_output(self, _line=None) -> None:
        self._last_output = time.monotonic()

    def request_dump(self, reason: str) -> None:
        """From a signal handler: only sets a flag; the watch thread does the work."""
        self._dump_reason = reason
        self._dump.set()

    def start(self, abort: Callable[[], None]) -> None:
        self._abort = abort
        t0 = time.monotonic()
        self._last_output = self._last_rec = self._last_log = t0
        if self.hang_timeout is not None:
            self._start_watchers()
        t = threading.Thread(target=self._loop, name="dtrun-hangwatch", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._dump.set()
        for p in self._agents:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        for t in self._threads:
            t.join(timeout=1)

    # -- the same, as a job observer of run_job (on_start / on_output / on_signal / on_end)
    def on_start(self, job) -> None:
        # Open MPI 5 names the job's PMIx namespace after this host and mpirun's pid: the kill
        # agent proves a daemon whose ranks have ended by it (agent.kill).
        self.nspace = pmix_namespace(job.pid)
        self.start(abort=lambda: job.stop(StopReason.HANG, f"no progress (--on-hang {self.on_hang})"))

    def on_output(self, _stream, _data) -> None:
        self.saw_output()

    def on_rank_start(self, rank, _host) -> None:
        # Until every rank has started, the job is starting (--start-timeout's business, and
        # ssh plus daemon start-up on busy hosts takes seconds): the clock starts from there.
        with self._lock:
            self._started.add(rank)
            if len(self._started) == self.job.np:
                self._last_output = self._last_rec = self._last_log = time.monotonic()

    def on_rank_exit(self, _failure) -> None:
        pass

    def on_signal(self, signum: int) -> bool:
        """SIGQUIT (Ctrl-\\) is the stack dump: handled here, so the job is not stopped."""
        if signum == signal.SIGQUIT:
            self.request_dump("SIGQUIT")
            return True
        return False

    def on_end(self, result) -> None:
        self.stop()
        if result.launcher == "srun" or result.stop is not None:
            return  # a job dtrun stopped gets kill_leftovers, which tidies too; under srun ssh may be blocked
        if self.cleanup_follows and result.returncode != 0:
            return
        others = [h for h in self.job.hosts if not is_local(h)]
        if self.reap_daemons:
            # Open MPI 5: a prted that PMIx deadlocked in its finalize outlives mpirun, ended
            # or failed, and nothing else ends it. The agent's kill tidies too.
            reap_remote_daemons(self.job, others, self.nspace)
        elif result.returncode != 0:
            # A failed rank's peers can be SIGKILLed by MPI before their wrappers tidy up; on a
            # host without a shared file system their files would stay.
            tidy_remote_hosts(self.job, others)

    # -- progress
    def _start_watchers(self) -> None:

        interval = max(0.2, min(1.0, self.hang_timeout / 5))
        for host in dict.fromkeys(self.job.hosts):
            try:
                p = subprocess.Popen(agent_argv(self.job, host, "watch", interval), stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
            except OSError:
                continue
            self._agents.append(p)
            t = threading.Thread(target=self._read_watch, args=(p,), daemon=True)
            t.start()
            self._threads.append(t)

    def _read_watch(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            try:
                ranks = parse_watch(json.loads(line))
            except ValueError:
                continue
            if ranks is None:
                continue  # not a watch line: one odd line must not end this host's watcher
            now = time.monotonic()
            with self._lock:
                for rank, (seq, log) in ranks.items():
                    prev = self._seen.get(rank)
                    if seq is not None:
                        self._runtime = True
                    if prev is None or (seq is not None and seq != prev[0]):
                        self._last_rec = now
                    if log is not None and (prev is None or log != prev[1]):
                        self._last_log = now
                    self._seen[rank] = [seq, log]

    def last_progress(self) -> float:
        with self._lock:
            if self._runtime:
                return self._last_rec
            return max(self._last_output, self._last_log)

    # -- the loop
    def _loop(self) -> None:
        fired_at: Optional[float] = None
        while not self._stop.is_set():
            woke = self._dump.wait(0.2)
            if self._stop.is_set():
                return
            if woke:
                self._dump.clear()
                self._report(f"stacks ({self._dump_reason}): the job goes on.", time.monotonic())
                continue
            if self.hang_timeout is None:
                continue
            last = self.last_progress()
            now = time.monotonic()
            if fired_at is not None and last > fired_at:
                fired_at = None  # progress resumed: a new stall will be reported again
            if fired_at is None and now - last >= self.hang_timeout:
                fired_at = now
                what = "collectives" if self._runtime else "output"
                self._report(f"hang: no progress for {now - last:.0f} s (no {what} from any rank).", now)
                if self.on_hang in ("abort", "restart"):
                    self.out(f"dtrun: --on-hang {self.on_hang}: stopping the job")
                    if self._abort:
                        self._abort()
                    return

    def _report(self, headline: str, detected: float) -> None:
        try:
            text, _path, _answers = report(self.job, headline, self.stacks_timeout)
        except Exception as exc:  # the report must never take the job down
            text = f"{headline}\n  (could not collect stacks: {type(exc).__name__}: {exc})"
        took = time.monotonic() - detected
        self.out(f"dtrun: {text}\n  (collected in {took:.2f} s)")
