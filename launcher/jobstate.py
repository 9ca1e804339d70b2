"""A running job's record, so that `dtrun stacks` in another terminal can find it.

dtrun writes ``<cache>/jobs/<id>/job.json`` (its pid, the hosts, the ssh config, the
Python that runs the rank wrapper) before it starts mpirun, and removes the directory
when the job ends. The same directory (its path, on every host) is the job directory
the rank wrappers and the collectives runtime write into (``$DTRUN_JOB_DIR``): per-rank
state files, faulthandler dumps and flight recorders (see launcher/remote/rankstate.py).

The record of a dtrun that was killed stays; it is removed only when it is provably dead,
since the same cache directory can be seen from other pid namespaces (a container, a
second login node sharing home) where dtrun's pid names nothing or another process: dtrun
holds an ``flock`` on ``job.lock`` in the directory for the job's life, and a record is
removed only when that lock file is ours and free AND dtrun's pid is not alive here (and
only on the machine that wrote it). The record also says where its dtrun runs (machine,
boot, pid namespace, start time), so `dtrun stacks` acts only on a job whose processes it
can see, and names the others.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from dtrun.launcher.errors import UsageError
from dtrun.launcher.paths import cache_dir
from dtrun.launcher.remote.procfs import proc_start
from dtrun.launcher.remote.sessiondirs import alive, claim, held

LOCK_NAME = "job.lock"
_held: dict[str, int] = {}  # job directory -> the descriptor holding its lock (this process's jobs)


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
    dtrun_start: int = 0  # dtrun's start time (clock ticks since boot): tells it from a later process with its pid
    pid_ns: str = ""  # dtrun's pid namespace ("pid:[4026531836]"): its pid means nothing in another
    boot_id: str = ""  # the boot dtrun runs in: another machine (a shared home) or an earlier boot differs
    launch_host: str = ""  # the machine dtrun runs on: only there is its record judged dead


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def runs_here(info: JobInfo) -> bool:
    """Whether the job's dtrun is a live process that this process can see: the same boot and
    pid namespace, and its pid's start time is the one recorded (records without them: alive)."""
    if info.boot_id and info.boot_id != _boot_id():
        return False
    if info.pid_ns and info.pid_ns != _pid_ns():
        return False
    if info.dtrun_start:
        found = proc_start(info.dtrun_pid)
        return found is not None and found[1] == info.dtrun_start and alive(info.dtrun_pid)
    return alive(info.dtrun_pid)


def _other_machine(info: JobInfo) -> bool:
    return bool(info.launch_host) and info.launch_host != socket.gethostname()


def where(info: JobInfo) -> str:
    """Where a job that does not run here runs, in words."""
    if _other_machine(info):
        return f"on {info.launch_host}"
    if info.boot_id and info.boot_id != _boot_id():
        return "on another machine sharing this cache directory"
    if info.pid_ns and info.pid_ns != _pid_ns():
        return f"in another pid namespace, {info.pid_ns} (this shell's is {_pid_ns() or 'unknown'})"
    return "elsewhere"


def jobs_dir() -> Path:
    return cache_dir() / "jobs"


def new_dir() -> str:
    """A fresh job directory on this host (mode 0700: stacks can hold secrets), its lock held
    by this process until ``remove`` (see the module doc)."""
    import fcntl

    base = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    jobs_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
    for n in range(1, 1000):
        # Never another's: the same second and pid happen in another pid namespace.
        d = jobs_dir() / (base if n == 1 else f"{base}-{n}")
        try:
            d.mkdir(mode=0o700)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{jobs_dir()}/{base}: taken")
    try:
        fd = os.open(d / LOCK_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return str(d)  # no lock file: the record is never taken for dead (the job runs all the same)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file in a new private directory: free
    except OSError:
        # A file system without flock: remove the lock file rather than leave one that looks free.
        os.unlink(d / LOCK_NAME)
        os.close(fd)
        return str(d)
    _held[str(d)] = fd
    return str(d)


def write(job_dir: str, hosts, np: int, ssh_config: Optional[str], log_dir: Optional[str], flavor: str,
          program) -> JobInfo:
    """Record the job in job_dir/job.json for `dtrun stacks`."""
    info = JobInfo(os.path.basename(job_dir), job_dir, tuple(hosts), int(np), os.getpid(), sys.executable,
                   ssh_config, log_dir, flavor, tuple(program)[:8], time.time(),
                   (proc_start(os.getpid()) or (None, 0))[1], _pid_ns(), _boot_id(), socket.gethostname())
    tmp = Path(job_dir) / "job.json.tmp"
    tmp.write_text(json.dumps(asdict(info)))
    os.replace(tmp, Path(job_dir) / "job.json")
    return info


def read(job_dir: str) -> Optional[JobInfo]:
    """The record ``write`` left in ``job_dir`` (dtrun's own private directory), or None."""
    try:
        data = json.loads((Path(job_dir) / "job.json").read_text())
        return JobInfo(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    except (OSError, ValueError, TypeError):
        return None


def remove(job_dir: str) -> None:
    """Remove the job's directory (its lock still held while it goes), then let the lock go."""
    shutil.rmtree(job_dir, ignore_errors=True)
    fd = _held.pop(job_dir, None)
    if fd is not None:
        os.close(fd)


@dataclass(frozen=True)
class JobListing:
    here: list[JobInfo]  # running, and this process sees their processes
    elsewhere: list[JobInfo]  # running (their lock is held) where this process cannot see them


def list_jobs() -> JobListing:
    """The recorded jobs, oldest first; records that are provably dead are removed: their
    lock file is ours and free, and dtrun's pid is not alive here. Any other is kept."""
    here, elsewhere = [], []
    root = jobs_dir()
    if not root.is_dir():
        return JobListing(here, elsewhere)
    for d in sorted(root.iterdir()):
        try:
            data = json.loads((d / "job.json").read_text())
            info = JobInfo(**{**data, "hosts": tuple(data["hosts"]), "program": tuple(data.get("program", ()))})
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if runs_here(info):
            here.append(info)
            continue
        # Another machine's record (a home shared between login nodes) is judged there only:
        # whether flock reaches across machines depends on how the file system is mounted.
        fd = None if _other_machine(info) else claim(str(d / LOCK_NAME))
        if fd is None:
            if held(str(d / LOCK_NAME)):
                elsewhere.append(info)  # its dtrun runs where this process cannot see it
            continue  # held, or no lock file of ours: nothing proves it dead
        try:
            if not alive(info.dtrun_pid):
                shutil.rmtree(d, ignore_errors=True)
        finally:
            os.close(fd)
    return JobListing(here, elsewhere)


def _elsewhere_note(jobs: list[JobInfo], command: str) -> str:
    if not jobs:
        return ""
    listing = "; ".join(f"{j.id}, dtrun pid {j.dtrun_pid} {where(j)}" for j in jobs)
    return (f"; {len(jobs)} running where this shell cannot see {'its' if len(jobs) == 1 else 'their'} "
            f"processes: {listing}; run dtrun {command} where the job runs")


def find_job(selector: Optional[str], command: str = "stacks") -> JobInfo:
    """The one running job, or the one whose id or dtrun pid is ``selector``; messages
    name ``command`` (the dtrun subcommand asking: stacks, top)."""
    listing = list_jobs()
    jobs = listing.here
    if selector:
        match = [j for j in jobs if selector in (j.id, str(j.dtrun_pid))]
        if not match:
            away = [j for j in listing.elsewhere if selector in (j.id, str(j.dtrun_pid))]
            if away:
                raise UsageError(f"dtrun job {away[0].id} runs {where(away[0])}, where this shell cannot see its "
                                 f"processes; run dtrun {command} where the job runs")
            raise UsageError(f"no running dtrun job {selector!r}; running: "
                             f"{', '.join(f'{j.id} (pid {j.dtrun_pid})' for j in jobs) or 'none'}"
                             + _elsewhere_note(listing.elsewhere, command))
        return match[0]
    if not jobs:
        raise UsageError(f"no running dtrun job found (looked in {jobs_dir()}); start one with dtrun, "
                         "or give the same XDG_CACHE_HOME as the job's" + _elsewhere_note(listing.elsewhere, command))
    if len(jobs) > 1:
        listing = "; ".join(f"{j.id} (pid {j.dtrun_pid}, {' '.join(j.program[:2])})" for j in jobs)
        raise UsageError(f"{len(jobs)} dtrun jobs are running: {listing}; choose one: dtrun {command} JOB")
    return jobs[0]
