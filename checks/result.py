"""What a check says about one host: a frozen ``Finding`` (ok / warn / fail / na)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

OK, WARN, FAIL, NA = "ok", "warn", "fail", "na"
_RANK = {NA: 0, OK: 1, WARN: 2, FAIL: 3}
SYMBOL = {OK: "✓", WARN: "!", FAIL: "✗", NA: "–"}

# The columns of doctor's table, in order.
CHECKS = ("ssh", "env", "network", "firewall", "gpu", "e2e")


@dataclass(frozen=True)
class Finding:
    """One answer of one check about one host.

    ``detail`` names the cause in full ("TCP to h3:22 refused — sshd is not running
    on h3"); ``fix`` says what to do. ``host`` is the host's name as the user gave
    it, or "*" for a finding about the whole job.
    """

    host: str
    check: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self):
        if self.status not in _RANK:
            raise ValueError(f"status must be one of {sorted(_RANK)}, got {self.status!r}")

    @property
    def message(self) -> str:
        return f"{self.host}: {self.detail}" + (f"; fix: {self.fix}" if self.fix else "")

    def to_dict(self) -> dict:
        return asdict(self)


def worst(statuses: Iterable[str]) -> str:
    """The most severe status (fail > warn > ok > na); na when there is none."""
    return max(statuses, key=_RANK.__getitem__, default=NA)


def from_error(check: str, err) -> Finding:
    """A failed Finding from a ``checks.errors.CheckError``."""
    return Finding(err.host, check, FAIL, err.detail, err.fix)


@dataclass(frozen=True)
class HostResults:
    """Every host's answer to one step run on all hosts at once (like fabric's ``GroupResult``).

    ``ok`` maps each host that answered to its value, ``failed`` each other host to the
    ``CheckError`` it raised, both in the order the hosts were given. Callers read the
    two maps instead of testing each value's type.
    """

    ok: dict
    failed: dict

    def findings(self, check) -> list[Finding]:
        """A failed Finding per failed host; ``check`` is the check's name, or a function of the host's."""
        return [from_error(check(host) if callable(check) else check, err) for host, err in self.failed.items()]
