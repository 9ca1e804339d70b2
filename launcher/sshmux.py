"""One ssh connection per host that a run with restarts keeps open, for the sessions it opens there.

A recovery opens many ssh sessions at once: the host agent on every host of the failed
attempt (the kill round, launcher/job/kill.py), then mpirun's daemons of the next attempt.
Each used to be a new connection, and 15 new connections at once take a second of this
machine's two cores (key exchange on both ends, sshd's start of a session). Under
``--max-restarts`` the run keeps one OpenSSH master connection (``ControlMaster``) per
remote host, opened in the background once an attempt's job runs (``OpenOnceStarted``), and
these sessions go through it: dtrun's agents (``control_args``), and under Open MPI the ssh of a later attempt's
mpirun (``shared_path``, in ``plm_ssh_args``). 15 sessions through masters take 0.1 s.

* **Private.** The control sockets live in a directory of the run's own (mode 0700, a
  random name, in the private ssh directory of launcher/sshconf.py), never in a shared
  place; a connection to them is this user's ssh connection to the host.
* **Nothing outlives the run.** A master's remote command reads its standard input, whose
  other end only dtrun holds: when the run ends (``close``), or dtrun dies however it dies,
  the input ends, then the master, once the sessions through it have ended.
* **Never needed.** A session to a host whose master is not up yet, failed, or has lost its
  host (a lost host is the usual reason for a recovery) connects by itself, as ssh does when
  the socket is missing.
* **A lost host is still named.** mpirun's ssh clients through a master say nothing when
  the host closes the connection; its master does ("Connection to X closed by remote
  host."), and the recovery reads it there (``closed_hosts``).
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from dtrun.launcher.errors import LaunchError
from dtrun.launcher.job.observer import JobObserver
from dtrun.launcher.restarts import closed_connections
from dtrun.launcher.sshconf import files_dir, private_dir

# Seconds a master gets to connect; the agents do not wait for it (they connect by themselves).
CONNECT_TIMEOUT_S = 10
# Seconds ``close`` gives the masters to end once their input has ended, before it kills them.
CLOSE_TIMEOUT_S = 2.0
# A control socket's path must fit in sockaddr_un's 108 bytes (ssh's %C is 40 characters).
_MAX_DIR_PATH = 59


class Masters:
    """The master connections of one run, one per remote host, by host name. Their sockets
    share one name pattern (``DIR/%C``: ssh's hash of the host, port and user), so one option
    string sends any host's session through its master (``shared_path``), Open MPI's too."""

    def __init__(self):
        self._dir: Optional[Path] = None
        self._procs: dict[str, subprocess.Popen] = {}
        self._errors: dict[str, list[str]] = {}  # what each master said on stderr
        self._lock = threading.Lock()
        self._closed = False

    @property
    def pattern(self) -> Optional[str]:
        return None if self._dir is None else str(self._dir / "%C")

    def start(self, hosts: Sequence[str], ssh_config: Optional[str]) -> None:
        """Open a master to each of ``hosts`` (remote, by name) that has none running; returns at once."""
        with self._lock:
            if self._closed:
                return
            if self._dir is None:
                self._dir = _private_dir()
                if self._dir is None:
                    return
            for host in dict.fromkeys(hosts):
                running = self._procs.get(host)
                if running is not None and running.poll() is None:
                    continue
                argv = ["ssh", "-o", "ControlMaster=yes", "-o", f"ControlPath={self.pattern}", "-o", "ControlPersist=no",
                        "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
                if ssh_config:
                    argv += ["-F", ssh_config]
                try:
                    p = subprocess.Popen(argv + [host, "exec cat >/dev/null"], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
                except OSError:
                    return
                self._procs[host] = p
                lines = self._errors[host] = []
                threading.Thread(target=_read_lines, args=(p.stderr, lines), name=f"dtrun-ssh-master-{host}",
                                 daemon=True).start()

    def control_args(self, host: str) -> list[str]:
        """The ssh options that send a session to ``host`` through its master while one runs;
        [] otherwise (ssh then connects by itself, as it also does while the master connects)."""
        with self._lock:
            p, pattern = self._procs.get(host), self.pattern
        if p is None or pattern is None or p.poll() is not None:
            return []
        return ["-o", "ControlMaster=no", "-o", f"ControlPath={pattern}"]

    def shared_path(self) -> Optional[str]:
        """The sockets' name pattern while any master runs (for mpirun's ssh: a host whose master
        is not up, or has none, is connected to by ssh itself), else None."""
        with self._lock:
            up = any(p.poll() is None for p in self._procs.values())
            return self.pattern if up else None

    def closed_hosts(self) -> list[str]:
        """The hosts whose master connection the far end closed ("Connection to X closed by
        remote host."): evidence of a lost host, as mpirun's own ssh clients would have said
        had they not gone through the master."""
        with self._lock:
            return [h for h, lines in self._errors.items() if closed_connections(list(lines))]

    def close(self) -> None:
        """End every master (their input closed, then killed after ``CLOSE_TIMEOUT_S``) and
        remove the sockets' directory."""
        with self._lock:
            self._closed = True
            procs = list(self._procs.values())
            self._procs.clear()
            folder, self._dir = self._dir, None
        for p in procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


class OpenOnceStarted(JobObserver):
    """A job observer (launcher/job/observer.py) that opens ``masters`` to ``hosts`` once the
    job runs: all ``np`` ranks have started and it has written its first output since. Opened
    earlier, beside mpirun's own ssh connections or the ranks' start, they slow the launch on
    a machine whose cores the hosts share (16 namespace hosts on 2 cores: 3.7 s to the first
    step became 4.5 s, and 5.2 s when opened as the ranks start). A failure before then finds
    no master, and its sessions connect by themselves."""

    def __init__(self, masters: Masters, hosts: Sequence[str], ssh_config: Optional[str], np: int):
        self.masters, self.hosts, self.ssh_config, self.np = masters, tuple(hosts), ssh_config, np
        self._started: set = set()
        self._opened = False
        self._lock = threading.Lock()

    def on_output(self, stream, data) -> None:
        with self._lock:
            if self._opened or len(self._started) < self.np:
                return
            self._opened = True
        # on a thread of its own: the caller is the thread that reads the job's output
        threading.Thread(target=self.masters.start, args=(self.hosts, self.ssh_config),
                         name="dtrun-ssh-masters", daemon=True).start()

    def on_rank_start(self, rank, host) -> None:
        with self._lock:
            self._started.add(rank)


def _read_lines(stream, lines: list, keep: int = 20) -> None:
    for raw in stream:
        if len(lines) < keep:
            lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
    stream.close()


def _private_dir() -> Optional[Path]:
    """A new directory of the run's own (0700, random name) for the control sockets: in the
    private ssh directory, or in ``/tmp/dtrun-UID/ssh`` where that path is too long for a
    socket; None where neither can be made."""
    name = f"mux-{secrets.token_hex(4)}"
    for base in (files_dir(), Path(f"/tmp/dtrun-{os.geteuid()}") / "ssh"):
        if len(str(base / name)) > _MAX_DIR_PATH:
            continue
        try:
            private_dir(base)
            os.mkdir(base / name, 0o700)
            return base / name
        except (LaunchError, OSError):
            return None
    return None


_active: Optional[Masters] = None


def activate(masters: Optional[Masters]) -> None:
    """Make ``masters`` the ones this process's agent sessions use (None: none)."""
    global _active
    _active = masters


def control_args(host: str) -> list[str]:
    """``Masters.control_args`` of the active masters ([] when there are none)."""
    m = _active
    return m.control_args(host) if m is not None else []
