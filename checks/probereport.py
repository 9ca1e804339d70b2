"""The probe's report (the JSON each host's probe answers with), parsed into dataclasses.

``launcher/remote/probe.py`` writes the report on the far host; ``parse_probe_report`` is
the one place that reads its JSON. It checks the type of every field the checks use, so a
report from a broken or foreign probe becomes a clear probe failure rather than a finding
built from quiet defaults. The interfaces and GPU parts stay mappings here: ``network`` and
``gpu`` parse them into their own dataclasses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union


class ProbeReportError(ValueError):
    """The report does not have the shape the probe writes: names the field."""


@dataclass(frozen=True)
class PathFacts:
    """What the probe saw at one absolute path (the job's Python, the cwd, mpirun, ...)."""

    exists: bool = False
    executable: bool = False
    isdir: bool = False


@dataclass(frozen=True)
class PythonFacts:
    """The job's Python on the host, and whether mpi4py loads in it."""

    version: Optional[str] = None
    is_job_python: bool = False
    mpi4py: Optional[str] = None
    mpi4py_error: Optional[str] = None


@dataclass(frozen=True)
class StaleSessions:
    """Session directories left by killed Open MPI 5 jobs (``count`` may exceed the paths listed)."""

    count: int = 0
    paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProbeReport:
    """One host's probe report; ``error`` set means the probe itself failed there."""

    error: Optional[str] = None
    hostname: Optional[str] = None
    path: str = ""  # PATH of a non-interactive shell
    ld_library_path: Optional[str] = None
    which: Mapping[str, str] = field(default_factory=dict)  # name -> where PATH finds it (found names only)
    paths: Mapping[str, PathFacts] = field(default_factory=dict)
    versions: Mapping[str, str] = field(default_factory=dict)  # program -> its --version output
    python: PythonFacts = PythonFacts()
    stale_sessions: StaleSessions = StaleSessions()
    interfaces: Mapping[str, Any] = field(default_factory=dict)
    gpu: Mapping[str, Any] = field(default_factory=dict)
    port: Optional[int] = None  # the probe's listener for the firewall check
    links_port: Optional[int] = None  # its listener for --links

    @property
    def ok(self) -> bool:
        return self.error is None

    def at(self, key: str) -> PathFacts:
        """The facts of the path the request named ``key``; all False when not probed."""
        return self.paths.get(key) or PathFacts()


def _typed(data: Mapping, key: str, kind, default=None, where: str = ""):
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ProbeReportError(f"{where}{key} is {type(value).__name__}, expected {names}")
    return value


def _strings(data: Mapping, key: str) -> dict[str, str]:
    """A {name: text} mapping whose missing values (None) are left out."""
    raw = _typed(data, key, dict, {})
    out = {}
    for name, value in raw.items():
        if value is not None:
            out[str(name)] = _typed(raw, name, str, where=f"{key}.")
    return out


def _path_facts(data: Mapping) -> dict[str, PathFacts]:
    out = {}
    for name, info in _typed(data, "paths", dict, {}).items():
        info = _typed(data["paths"], name, dict, {}, where="paths.")
        out[str(name)] = PathFacts(exists=bool(info.get("exists")), executable=bool(info.get("exec")),
                                   isdir=bool(info.get("isdir")))
    return out


def _python(data: Mapping) -> PythonFacts:
    py = _typed(data, "python", dict, {})
    return PythonFacts(version=_typed(py, "version", str, where="python."),
                       is_job_python=bool(py.get("is_job_python")),
                       mpi4py=_typed(py, "mpi4py", str, where="python."),
                       mpi4py_error=_typed(py, "mpi4py_error", str, where="python.") or None)


def _stale(data: Mapping) -> StaleSessions:
    stale = _typed(data, "stale_sessions", dict, {})
    paths = _typed(stale, "paths", list, [], where="stale_sessions.")
    if not all(isinstance(p, str) for p in paths):
        raise ProbeReportError("stale_sessions.paths holds a value that is not a path")
    return StaleSessions(count=_typed(stale, "count", int, 0, where="stale_sessions."), paths=tuple(paths))


def parse_probe_report(data: Any) -> ProbeReport:
    """The report from its decoded JSON.

    Raises:
        ProbeReportError: a field the checks read has the wrong type (the message names it).
    """
    if not isinstance(data, Mapping):
        raise ProbeReportError(f"the report is {type(data).__name__}, expected an object")
    error = _typed(data, "error", str)
    if error:
        return ProbeReport(error=error)
    env = _typed(data, "env", dict, {})
    return ProbeReport(
        hostname=_typed(data, "hostname", str), path=_typed(env, "PATH", str, "", where="env."),
        ld_library_path=_typed(env, "LD_LIBRARY_PATH", str, where="env."),
        which=_strings(data, "which"), paths=_path_facts(data), versions=_strings(data, "versions"),
        python=_python(data), stale_sessions=_stale(data),
        interfaces=_typed(data, "interfaces", dict, {}), gpu=_typed(data, "gpu", dict, {}),
        port=_typed(data, "port", int), links_port=_typed(data, "links_port", int))


def probe_report(data: Union[ProbeReport, Any]) -> ProbeReport:
    """``data`` as a ProbeReport; a malformed one becomes a report whose ``error`` says what is wrong."""
    if isinstance(data, ProbeReport):
        return data
    try:
        return parse_probe_report(data)
    except ProbeReportError as exc:
        return ProbeReport(error=f"malformed probe report: {exc}")
