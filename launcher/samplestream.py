"""The host agents' sample stream: ``agent.py sample`` on every host of a job at once, each
printing one line per window on how its ranks spent it (launcher/remote/waitsampler.py).

Separate from the straggler finding (launcher/straggler.py) because two readers share it:
the straggler watch during a job, and ``dtrun top`` (launcher/top.py) from another terminal.
Each host's lines are parsed at the edge (launcher/agentreport.py); a host whose agent
printed nothing gets a ``HostSample`` that says why.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable, Optional

from dtrun.launcher.agentreport import HostSample, parse_sample
from dtrun.launcher.job.agents import agent_argv
from dtrun.launcher.jobstate import JobInfo


class SampleStream:
    """``agent.py sample`` on every host of the job at once, one line per window each; ``window``
    and ``rate``: the seconds each line covers and the stack samples per second."""

    def __init__(self, job: JobInfo, window: float, rate: float, once: bool = False,
                 on_sample: Optional[Callable[[HostSample], None]] = None, connect_timeout: float = 5.0):
        self.job, self.window, self.rate, self.once = job, window, rate, once
        self.on_sample = on_sample
        self.connect_timeout = connect_timeout
        self.hosts = list(dict.fromkeys(job.hosts))
        self._latest: dict[str, HostSample] = {}
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        via = "faulthandler" if os.environ.get("DTRUN_NO_PYSPY", "").strip() == "1" else "auto"
        extra = [f"{self.rate:g}", via] + (["once"] if self.once else [])
        for host in self.hosts:
            argv = agent_argv(self.job, host, "sample", self.window, extra, connect_timeout=self.connect_timeout)
            try:
                p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True, start_new_session=True)
            except OSError as exc:
                self._put(HostSample(host, error=f"cannot run {argv[0]}: {exc.strerror}"))
                continue
            self._procs.append(p)
            t = threading.Thread(target=self._read, args=(host, p), daemon=True)
            t.start()
            self._threads.append(t)

    def _put(self, sample: HostSample) -> None:
        sample = replace(sample, at=time.monotonic())
        with self._lock:
            self._latest[sample.host] = sample
        if self.on_sample is not None:
            try:
                self.on_sample(sample)
            except Exception:  # an observer's failure must never stop the readers
                pass

    def _read(self, host: str, p: subprocess.Popen) -> None:
        err: deque = deque(maxlen=5)
        t = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
        t.start()
        got = False
        for line in p.stdout:
            try:
                sample = parse_sample(json.loads(line), host, self.window)
            except ValueError:
                continue
            if sample is not None:
                got = True
                self._put(sample)
        p.wait()
        t.join(1)
        if not got:
            why = next((ln.strip() for ln in reversed(err) if ln.strip()), f"exit code {p.returncode}")
            self._put(HostSample(host, error=why[:200]))

    def latest(self) -> dict[str, HostSample]:
        with self._lock:
            return dict(self._latest)

    def wait_all(self, deadline: float) -> bool:
        """Until every host has answered (a line or an error) or ``deadline`` (monotonic)."""
        while time.monotonic() < deadline:
            if len(self.latest()) == len(self.hosts):
                return True
            time.sleep(0.05)
        return len(self.latest()) == len(self.hosts)

    def running(self) -> bool:
        """Whether some host's agent still runs (they end when their ranks have ended)."""
        return any(p.poll() is None for p in self._procs)

    def wait_ended(self, timeout: float) -> None:
        """Until every agent has ended by itself (its ranks ended), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
