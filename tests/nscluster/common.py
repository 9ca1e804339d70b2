"""What every part of the namespace cluster shares: names, paths, errors and plumbing.

Commands run through ``_run`` (captured text, a timeout, ``ClusterError`` on failure);
processes are found and stopped through ``/proc`` so that teardown works from names alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

STATE_DIR = Path(os.environ.get("DTRUN_NSCLUSTER_DIR", "/tmp/dtrun-nscluster"))
MARKER = "dtrun-nscluster"  # tags /etc/hosts lines and root-namespace iptables rules
NETNS_PREFIX = "dtrun-"  # namespace names: dtrun-<host name>
BRIDGE_PREFIX = "dtbr-"
VETH_PREFIX = "dtv-"
HOSTS_FILE = Path("/etc/hosts")
SSHD = "/usr/sbin/sshd"  # sshd re-executes itself and insists on an absolute path
REPO_ROOT = Path(__file__).resolve().parents[2]

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{1,7}$")  # "dtv-<prefix>-<i>" must fit IFNAMSIZ (15)
_MAX_HOSTS = 99
_CMD_TIMEOUT = 10.0


def _venv_bin() -> Path:
    """The bin directory of the virtual environment running this code (CI clones anywhere)."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "bin"
    if (REPO_ROOT / ".venv" / "bin").is_dir():
        return REPO_ROOT / ".venv" / "bin"
    return Path(sys.executable).parent


VENV_BIN = _venv_bin()


class ClusterError(RuntimeError):
    """Building, changing or tearing down a namespace cluster failed."""


class ClusterUnavailable(ClusterError):
    """This machine cannot host a namespace cluster (not root, no netns, no sshd, ...)."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One namespace host: its unique hostname, its address on the bridge, its namespace."""

    name: str
    addr: str
    netns: str


class _ClusterBase:
    """The attributes that every part of ``Cluster`` reads (set in ``__init__`` and ``up``)."""

    prefix: str
    n: int
    workdir: Path
    state_file: Path
    bridge: str
    subnet: str
    gateway: str
    hosts: list[Host]
    origin: str
    cluster_faults: frozenset[str]
    _names: list[str]  # host names, known before up()
    _faults: dict[str, set[str]]  # host name -> its faults
    _denied: set[tuple[str, str]]  # (source, destination) host names whose ssh is refused
    _is_up: bool


def _run(argv: Sequence[str], *, timeout: float = _CMD_TIMEOUT, check: bool = True,
         input: str | None = None) -> subprocess.CompletedProcess:
    """Run a command with captured text output and a timeout; raise ClusterError on failure."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              input=input, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"{shlex.join(argv)} timed out after {timeout:g} s") from exc
    except OSError as exc:
        raise ClusterError(f"{shlex.join(argv)}: {exc}") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise ClusterError(f"{shlex.join(argv)} exited {proc.returncode}: {detail}")
    return proc


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialise subnet allocation and /etc/hosts edits between concurrent processes."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------
# Processes, found through /proc
# ---------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    """True for a running process; zombies (already dead, not yet reaped) count as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _kill_and_wait(pids: Sequence[int], sig: int = signal.SIGKILL, wait: float = 2.0) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    deadline = time.monotonic() + wait
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _pids_with_cmdline(fragment: str) -> list[int]:
    """sshd daemons and ssh clients whose command line contains ``fragment`` (a workdir).

    Only the cluster's own plumbing: other tools that merely name the cluster's files
    (a launcher given its ssh_config, say) belong to whoever started them.
    """
    needle = fragment.encode()
    spared = _ancestors()  # never this process or whatever started it
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        argv0 = cmdline.split(b"\0", 1)[0]
        plumbing = argv0.startswith(b"sshd:") or os.path.basename(argv0) in (b"sshd", b"ssh")
        if plumbing and needle in cmdline:
            found.append(int(entry.name))
    return found


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"
