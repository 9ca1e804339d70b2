"""Where each host's name leads over ssh (its HostName), found while the attempt runs.

ssh names a connection the far end closed by the HostName it connected to ("Connection to
10.0.0.2 closed by remote host."), not by the name dtrun gave it. Telling which host that
was takes ``ssh -G HOST`` for each host: a read of the ssh config, no network, but a process
per host. Under ``--max-restarts`` the run starts these at the attempt's start, in the
background, so that a failure's recovery (launcher/run.py) does not wait for them: 15
``ssh -G`` on a machine busy with a failed job's tear-down took a second.
"""
from __future__ import annotations

import subprocess
import threading
import time
from typing import Optional, Sequence

from dtrun.launcher.restarts import ssh_hostname

# Seconds `ssh -G` gets to say where each host's name leads (no network: it reads the config).
SSH_CONFIG_TIMEOUT_S = 2.0


def ssh_hostnames(ssh_config: Optional[str], hosts: Sequence[str],
                  timeout: float = SSH_CONFIG_TIMEOUT_S) -> dict[str, str]:
    """{host: the HostName ssh connects to} by `ssh -G` (all at once, bounded by ``timeout``).

    A host whose ``ssh -G`` fails or does not answer in time is left out."""
    procs = {}
    for host in hosts:
        argv = ["ssh", "-G"] + (["-F", ssh_config] if ssh_config else []) + ["--", host]
        try:
            procs[host] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                           stdin=subprocess.DEVNULL, text=True)
        except OSError:
            break
    deadline = time.monotonic() + timeout
    found = {}
    for host, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            continue
        name = ssh_hostname(out) if p.returncode == 0 else None
        if name:
            found[host] = name
    return found


class SshNames:
    """``ssh_hostnames`` for ``hosts``, run on a thread of its own from construction."""

    def __init__(self, ssh_config: Optional[str], hosts: Sequence[str]):
        self.ssh_config, self.hosts = ssh_config, tuple(hosts)
        self._found: dict[str, str] = {}
        self._thread = threading.Thread(target=self._run, name="dtrun-ssh-names", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._found = ssh_hostnames(self.ssh_config, self.hosts)

    def get(self, hosts: Sequence[str]) -> dict[str, str]:
        """{host: HostName} for ``hosts``: the background answer (waited for, within its bound),
        and ``ssh -G`` now for any host it did not cover."""
        self._thread.join(SSH_CONFIG_TIMEOUT_S + 1.0)
        found = {h: self._found[h] for h in hosts if h in self._found} if not self._thread.is_alive() else {}
        missing = [h for h in hosts if h not in found]
        if missing:
            found.update(ssh_hostnames(self.ssh_config, missing))
        return found
