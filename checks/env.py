"""The remote environment as mpirun will see it: PATH, libraries, MPI, Python, paths.

The probe reports what a non-interactive shell on the host has (the same shell
``ssh host cmd`` and mpirun's daemons get); ``env_findings`` compares it with this
host's ``LocalFacts`` and names both values of every mismatch. Pure.
"""
from __future__ import annotations

import os
import shlex
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Optional, Union

from dtrun.checks.probereport import ProbeReport, probe_report
from dtrun.checks.result import FAIL, OK, WARN, Finding
from dtrun.launcher.errors import MpiFlavorError
from dtrun.launcher.flavors import Flavor, parse_version_output
from dtrun.launcher.remote.probe import NAMES, signature

CHECK = "env"
DAEMONS = {("openmpi", 5): "prted", ("openmpi", 4): "orted", ("mpich", 0): "hydra_pmi_proxy"}
NON_INTERACTIVE_FIX = ("set it for non-interactive shells on {host}: at the top of ~/.bashrc, before its "
                       "'[ -z \"$PS1\" ] && return' line, or with SetEnv in {host}'s sshd_config")


def daemon_name(kind: str, major: int) -> str:
    """The program mpirun starts on every remote host: prted (Open MPI 5), orted (4), hydra_pmi_proxy."""
    if kind == "openmpi":
        return DAEMONS[("openmpi", 5 if major >= 5 else 4)]
    return DAEMONS[("mpich", 0)]


@dataclass(frozen=True)
class LocalFacts:
    """The launching host's side of every comparison."""

    mpi_kind: str
    mpi_version: tuple[int, ...]
    mpi_label: str
    mpirun: str
    daemon: str  # name
    daemon_path: Optional[str]
    python: str
    python_version: str
    mpi4py: Optional[str]
    path: str
    ld_library_path: Optional[str]
    cwd: str
    program: Optional[str] = None

    def probe_request(self) -> dict:
        """What the probe needs to look at; data, sent as JSON."""
        paths = {"python": self.python, "cwd": self.cwd, "mpirun": self.mpirun}
        if self.daemon_path:
            paths["daemon"] = self.daemon_path
        if self.program:
            paths["program"] = self.program
        return {"paths": paths, "mpirun_sig": signature(self.mpirun), "launch_path": self.path,
                "names": list(NAMES)}


def local_facts(flavor, local_report: Union[ProbeReport, Mapping, None], program: Optional[str],
                environ: Optional[Mapping[str, str]] = None) -> LocalFacts:
    """This host's facts: the flavor from launcher.flavors, Python and mpi4py from the local probe."""
    environ = os.environ if environ is None else environ
    daemon = daemon_name(flavor.kind, flavor.major)
    path = os.path.join(os.path.dirname(flavor.mpirun), daemon)
    py = probe_report(local_report or {}).python
    return LocalFacts(
        mpi_kind=flavor.kind, mpi_version=tuple(flavor.version), mpi_label=flavor.label, mpirun=flavor.mpirun,
        daemon=daemon, daemon_path=path if os.path.exists(path) else None,
        python=sys.executable, python_version=py.version or "%d.%d.%d" % sys.version_info[:3],
        mpi4py=py.mpi4py, path=environ.get("PATH", ""), ld_library_path=environ.get("LD_LIBRARY_PATH") or None,
        cwd=os.getcwd(), program=os.path.abspath(program) if program else None,
    )


def _mpi_label(text: Optional[str]) -> Optional[str]:
    """'Open MPI 4.1.4' from --version output, or the first line when dtrun does not know it."""
    if not text:
        return None
    try:
        kind, version = parse_version_output(text)
    except MpiFlavorError:
        return (text.strip().splitlines() or ["no output"])[0][:80]
    return Flavor(kind, version).label


def env_findings(host: str, rep: Union[ProbeReport, Mapping], local: LocalFacts,
                 is_this_host: bool = False) -> list[Finding]:
    """Findings of the env check for one host from its probe report.

    This host (``localhost`` in the host list) is the reference the others are compared
    with; mpirun starts its ranks there without a remote shell, so PATH is not a concern.
    """
    rep = probe_report(rep)
    if rep.error:
        return [Finding(host, CHECK, FAIL, f"the probe failed on {host}: {rep.error}",
                        f"run `ssh {host} python3 -V` to see what a non-interactive shell there can run")]
    if is_this_host:
        return this_host_findings(host, rep, local)
    out = [Finding(host, CHECK, status, detail, fix)
           for part in (_mpi_install, _daemon_on_path, _other_mpi_on_path, _stale_sessions, _job_python,
                        _library_path, _workdir_and_program)
           for status, detail, fix in part(host, rep, local)]
    if not any(f.status != OK for f in out):
        extra = f", {local.program} present" if local.program else ""
        mpi4py = f" with mpi4py {rep.python.mpi4py}" if rep.python.mpi4py else ""
        out.append(Finding(host, CHECK, OK, f"{local.mpi_label}, {local.daemon} on PATH; Python "
                                            f"{rep.python.version}{mpi4py}; {local.cwd} present{extra}"))
    return out


# Each part of the env check: (status, detail, fix) for what it found wrong on one host.
_Problems = list[tuple[str, str, str]]


def _mpi_install(host: str, rep: ProbeReport, local: LocalFacts) -> _Problems:
    """The MPI install dtrun launches from, at the same absolute path as here."""
    if not rep.at("mpirun").executable:
        return [(FAIL, f"{local.mpirun} does not exist on {host} ({local.mpi_label} is there on this host); mpirun "
                       f"starts the remote daemons from the same installation path",
                 f"install {local.mpi_label} at the same path on {host} (a shared file system or the same virtual "
                 f"environment on every host)")]
    label = _mpi_label(rep.versions.get(local.mpirun))
    if label and label != local.mpi_label:
        return [(FAIL, f"{local.mpirun} on {host} is {label}; on this host it is {local.mpi_label}: "
                       f"daemons of different versions cannot talk",
                 f"install {local.mpi_label} on {host} at {os.path.dirname(local.mpirun)}")]
    return []


def _daemon_on_path(host: str, rep: ProbeReport, local: LocalFacts) -> _Problems:
    """The daemon mpirun starts, on the remote non-interactive PATH."""
    if rep.which.get(local.daemon):
        return []
    if rep.at("daemon").executable:
        return [(WARN, f"{local.daemon} is not on {host}'s non-interactive PATH ({rep.path or 'unset'}); dtrun starts "
                       f"mpirun by its absolute path, so {local.mpi_label} finds {local.daemon} at {local.daemon_path}, "
                       f"but a plain `mpirun` fails there with '{local.daemon}: command not found'",
                 f"put {os.path.dirname(local.mpirun)} on PATH for non-interactive shells on {host} "
                 f"(top of ~/.bashrc, before the interactive guard), or always launch with dtrun")]
    return [(FAIL, f"{local.daemon} (the daemon mpirun starts on every host) is neither on {host}'s "
                   f"non-interactive PATH ({rep.path or 'unset'}) nor at {local.daemon_path or 'the launch path'}",
             f"install {local.mpi_label} on {host} at the same path as here")]


def _other_mpi_on_path(host: str, rep: ProbeReport, local: LocalFacts) -> _Problems:
    """Another MPI's mpirun or mpiexec first on the remote PATH (dtrun is not affected; users are)."""
    for name in ("mpirun", "mpiexec"):
        found = rep.which.get(name)
        if not found or found == local.mpirun:
            continue
        label = _mpi_label(rep.versions.get(found))
        if label and label != local.mpi_label:
            return [(WARN, f"`{name}` on {host}'s non-interactive PATH is {label} ({found}); this host launches "
                           f"{local.mpi_label} ({local.mpirun})",
                     f"dtrun runs mpirun by absolute path and is not affected; put {os.path.dirname(local.mpirun)} "
                     f"before {os.path.dirname(found)} on {host}'s PATH so that a plain `{name}` and other tools agree")]
    return []


def _stale_sessions(host: str, rep: ProbeReport, local: LocalFacts) -> _Problems:
    """What killed Open MPI 5 jobs left (launcher/remote/sessiondirs.py)."""
    n, dirs = rep.stale_sessions.count, list(rep.stale_sessions.paths)
    if not n:
        return []
    shown = ", ".join(dirs[:3]) + (", …" if n > 3 else "")
    return [(WARN, f"{n} session director{'y' if n == 1 else 'ies'} of killed Open MPI 5 jobs on {host} ({shown}): "
                   f"a daemon that is given one of those pids stops at start-up and mpirun reports "
                   f"'Daemon exit status: 213'",
             f"dtrun's rank wrapper removes them during the next job on {host}; to remove them now: "
             f"ssh {shlex.quote(host)} rm -rf {' '.join(shlex.quote(d) for d in dirs)}"
             + (f" (the first {len(dirs)} of {n})" if n > len(dirs) else ""))]


def _job_python(host: str, rep: ProbeReport, local: LocalFacts) -> _Problems:
    """The job's Python at the same path, its version, and mpi4py with the libraries it loads."""
    py, ld = rep.python, rep.ld_library_path
    if not rep.at("python").executable:
        return [(FAIL, f"{local.python} (Python {local.python_version}, the job's interpreter here) does not exist on "
                       f"{host}; its non-interactive PATH finds python3 at {rep.which.get('python3') or 'nowhere'}",
                 f"create the same virtual environment at the same path on {host}, or use a shared file system")]
    if not py.is_job_python:
        return []
    out = []
    if py.version != local.python_version:
        out.append((FAIL, f"{local.python} on {host} is Python {py.version}; here it is {local.python_version}",
                    "use the same Python version on every host (pickled objects and compiled extensions differ)"))
    if py.mpi4py_error:
        err = py.mpi4py_error
        lib = "cannot open shared object" in err or "libmpi" in err or err.startswith("OSError")
        out.append((FAIL, f"mpi4py does not load on {host}: {err}" +
                    (f" (LD_LIBRARY_PATH there: {ld or 'unset'}; here: {local.ld_library_path or 'unset'})" if lib else ""),
                    NON_INTERACTIVE_FIX.format(host=host).replace("set it", "set LD_LIBRARY_PATH") if lib
                    else f"pip install mpi4py in {os.path.dirname(os.path.dirname(local.python))} on {host}"))
    elif local.mpi4py and py.mpi4py != local.mpi4py:
        out.append((WARN, f"mpi4py {py.mpi4py} on {host}, {local.mpi4py} here", f"install mpi4py=={local.mpi4py} on {host}"))
    return out


def _library_path(host: str, rep: ProbeReport, local: LocalFacts) -> _Problems:
    """LD_LIBRARY_PATH entries this host has and the remote non-interactive shell lacks."""
    ld = rep.ld_library_path
    if not local.ld_library_path or ld == local.ld_library_path:
        return []
    missing = [d for d in local.ld_library_path.split(":") if d and d not in (ld or "").split(":")]
    if not missing:
        return []
    return [(WARN, f"LD_LIBRARY_PATH in a non-interactive shell on {host} is {ld or 'unset'}; here it is "
                   f"{local.ld_library_path} (missing there: {':'.join(missing)}); dtrun forwards it to the ranks "
                   f"(-x LD_LIBRARY_PATH), but mpirun's daemons and plain `ssh {host} cmd` start without it",
             NON_INTERACTIVE_FIX.format(host=host).replace("set it", f"set LD_LIBRARY_PATH={local.ld_library_path}"))]


def _workdir_and_program(host: str, rep: ProbeReport, local: LocalFacts) -> _Problems:
    """The working directory and the program, at the same paths as here."""
    out = []
    if not rep.at("cwd").isdir:
        out.append((FAIL, f"the working directory {local.cwd} does not exist on {host}; mpirun starts every rank there",
                    f"create it on {host}, or launch from a directory on the shared file system"))
    if local.program and not rep.at("program").exists:
        out.append((FAIL, f"the program {local.program} does not exist on {host}",
                    f"copy it to {host} at the same path (rsync -a {shlex.quote(local.program)} "
                    f"{shlex.quote(host + ':' + local.program)}), or keep code on a shared file system"))
    return out


def this_host_findings(host: str, rep: Union[ProbeReport, Mapping], local: LocalFacts) -> list[Finding]:
    py = probe_report(rep).python
    if py.mpi4py_error:
        return [Finding(host, CHECK, FAIL, f"mpi4py does not load on this host: {py.mpi4py_error}",
                        f"pip install mpi4py into {os.path.dirname(os.path.dirname(local.python))}")]
    mpi4py = f" with mpi4py {py.mpi4py}" if py.mpi4py else " without mpi4py"
    return [Finding(host, CHECK, OK, f"this host, the reference for the others: {local.mpi_label} ({local.mpirun}), "
                                     f"Python {py.version}{mpi4py}")]


def consistency_findings(reports: Mapping[str, Union[ProbeReport, Mapping]], local: LocalFacts) -> list[Finding]:
    """LD_LIBRARY_PATH that differs between hosts (the odd ones out are named with both values)."""
    parsed = {h: probe_report(r) for h, r in reports.items()}
    values = {h: r.ld_library_path or "" for h, r in parsed.items() if r.ok}
    if len(set(values.values())) < 2:
        return []
    counts = Counter(values.values())
    common = max(counts, key=lambda v: (counts[v], bool(v)))
    holders = sorted(h for h, v in values.items() if v == common)
    out = []
    for h, v in values.items():
        if v == common or (local.ld_library_path and v != local.ld_library_path):
            continue  # the comparison with this host already named it
        out.append(Finding(h, CHECK, WARN,
                           f"LD_LIBRARY_PATH in a non-interactive shell on {h} is {v or 'unset'}; on "
                           f"{', '.join(holders)} it is {common or 'unset'}: libraries found there may be missing here",
                           NON_INTERACTIVE_FIX.format(host=h).replace("set it", f"set LD_LIBRARY_PATH={common}")
                           if common else f"unset LD_LIBRARY_PATH on {h} or set it on the others alike"))
    return out
