"""The hosts while ``dtrun doctor`` runs: each one's connection, probe, report and current step.

A ``HostRun`` is filled in by its host's worker in each round (``checks/doctor.py``, then
``checks/crosshost.py``); ``DoctorHosts`` holds the job's hosts and this host as a helper
when it is not one of them; ``Progress`` shows each host's step live on a terminal. Apart
from the doctor so that its rounds share these types without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dtrun.checks.probereport import ProbeReport
from dtrun.checks.probesession import ProbeSession
from dtrun.checks.ssh import SshConnection
from dtrun.checks.sshtarget import SshTarget

MAX_WORKERS = 32  # hosts worked on at once in each round


@dataclass
class HostRun:
    """One host's state while doctor runs (its connection, probe and report, set by its worker)."""

    name: str
    slots: int
    local: bool
    target: Optional[SshTarget] = None  # None for this host, which needs no ssh
    conn: Optional[SshConnection] = None
    probe: Optional[ProbeSession] = None
    report: Optional[ProbeReport] = None  # parsed as it arrives (checks/probereport.py)
    times: dict = field(default_factory=dict)
    step: str = "waiting"


@dataclass(frozen=True)
class DoctorHosts:
    """The job's hosts, plus this host as a helper when it is not one of them (mpirun runs here)."""

    runs: list
    helper: Optional[HostRun]

    @property
    def everyone(self) -> list:
        return self.runs + ([self.helper] if self.helper else [])

    @property
    def launcher_in_list(self) -> bool:
        return self.helper is None

    def order(self) -> dict:
        return {r.name: i for i, r in enumerate(self.everyone)}


class Progress:
    """A live line per host on stderr while doctor runs (only on a terminal), gone afterwards."""

    def __init__(self, enabled: bool):
        self.enabled, self.runs, self.live = enabled, [], None

    def show(self, runs: list[HostRun]) -> None:
        self.runs = runs
        if self.enabled and runs:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(get_renderable=self._render, console=Console(stderr=True), refresh_per_second=8,
                             transient=True)
            self.live.start()

    def _render(self):
        from rich.text import Text

        width = max(len(r.name) for r in self.runs)
        return Text("\n".join(f"{r.name.ljust(width)}  {r.step}" for r in self.runs))

    def stop(self) -> None:
        if self.live:
            self.live.stop()
            self.live = None
