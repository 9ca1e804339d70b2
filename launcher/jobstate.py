"""A running job's record, so that `dtrun stacks` in another terminal can find it.

dtrun writes ``<cache>/jobs/<id>/job.json`` (its pid, the hosts, the ssh config, the
Python that runs the rank wrapper) before it starts mpirun, and removes the directory
when the job ends. The same directory (its path, on every host) is the job directory
the rank wrappers and the collectives runtime write into (``$DTRUN_JOB_DIR``): per-rank
state files, faulthandler dumps and flight recorders (see launcher/rankstate.py).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from launcher.errors import UsageError
from launcher.paths import cache_dir
from launcher.sessiondirs import alive


@dataclass(frozen=True)
class JobInfo:
    id: str
    dir: str
    hosts: tuple[str, ...]
    np: int
    dtrun_pid: int
    python: str = sys.executable
    ssh_config: Optional[str] = None
    log_dir: Optional[str] = None
    flavor: str = ""
    program: tuple[str, ...] = field(default_factory=tuple)
    started: float = 0.0


def jobs_dir() -> Path:
    return cache_dir() / "jobs"


def new_dir() -> str:
    """A fresh job directory on this host (mode 0700: stacks can hold secrets)."""
    job_id = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    d = jobs_dir() / job_id
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return str(d)


def write(job_dir: str, hosts, np: int, ssh_config: Optional[str], log_dir: Optional[str], flavor: str,
          program) -> JobInfo:
    """Record the job in job_dir/job.json for `dtrun stacks`."""
    info = JobInfo(os.path.basename(job_dir), job_dir, tuple(hosts), int(np), os.getpid(), sys.executable,
                   ssh_config, log_dir, flavor, tuple(program)[:8], time.time())
    tmp = Path(job_dir) / "job.json.tmp"
    tmp.write_text(json.dumps(asdict(info)))
    os.replace(tmp, Path(job_dir) / "job.json")
    return info


def remove(job_dir: str) -> None:
    shutil.rmtree(job_dir, ignore_errors=True)


def running_jobs() -> list[JobInfo]:
    """Jobs whose dtrun is still alive, oldest first; stale records are removed."""
    found = []
    root = jobs_dir()
    if not root.is_dir():
        return found
    for d in sorted(root.iterdir()):
        try:
            data = json.loads((d / "job.json").read_text())
            info = JobInfo(**{**data, "hosts": tuple(data["hosts"]), "program": tuple(data.get("program", ()))})
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if alive(info.dtrun_pid):
            found.append(info)
        else:
            shutil.rmtree(d, ignore_errors=True)
    return found


def find_job(selector: Optional[str]) -> JobInfo:
    """The one running job, or the one whose id or dtrun pid is ``selector``."""
    jobs = running_jobs()
    if selector:
        match = [j for j in jobs if selector in (j.id, str(j.dtrun_pid))]
        if not match:
            raise UsageError(f"no running dtrun job {selector!r}; running: "
                             f"{', '.join(f'{j.id} (pid {j.dtrun_pid})' for j in jobs) or 'none'}")
        return match[0]
    if not jobs:
        raise UsageError(f"no running dtrun job found (looked in {jobs_dir()}); start one with dtrun, "
                         "or give the same XDG_CACHE_HOME as the job's")
    if len(jobs) > 1:
        listing = "; ".join(f"{j.id} (pid {j.dtrun_pid}, {' '.join(j.program[:2])})" for j in jobs)
        raise UsageError(f"{len(jobs)} dtrun jobs are running: {listing}; choose one: dtrun stacks JOB")
    return jobs[0]
