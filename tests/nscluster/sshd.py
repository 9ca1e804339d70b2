"""The SSH side of the cluster: keys, client and server configuration, one sshd per host.

Non-interactive environment of each host (what ``ssh host CMD`` sees), set with sshd's
``SetEnv`` because sshd builds a session's environment from scratch:

* healthy: ``PATH=<venv>/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin``
  (``<venv>`` is this interpreter's virtual environment, found at run time) and
  ``LD_LIBRARY_PATH=/usr/local/lib`` (harmless, but present, like a node whose admin
  exported a library path);
* ``bad_path``: ``PATH=/usr/bin:/bin`` (no virtual environment);
* ``no_ld_library_path``: ``LD_LIBRARY_PATH`` is not set at all;
* ``other_mpi``: ``PATH=<workdir>/other-mpi/bin:`` + the PATH above, where that directory
  holds ``mpirun``/``mpiexec``/``orterun`` -> ``/usr/bin/orterun`` (Debian's Open MPI
  4.1.4) and ``ompi_info``/``orted`` -> ``/usr/bin``. The venv's Open MPI 5 stays
  reachable by absolute path; only the bare names resolve to another MPI.

Every host also gets ``SHLVL=1``: bash sources ``~/.bashrc`` for commands run by sshd
only in a top-level shell, and root's ``.bashrc`` on developer machines prepends pyenv
or cargo directories to PATH. With ``SHLVL=1`` bash starts at level 2 and skips it, so a
host's environment is exactly the one declared here.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

from .common import (SSHD, VENV_BIN, _CMD_TIMEOUT, ClusterError, Host, _ClusterBase, _kill_and_wait,
                     _pid_alive, _run)
from .namespaces import _listening

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BAD_PATH = "/usr/bin:/bin"
HEALTHY_PATH = f"{VENV_BIN}:{SYSTEM_PATH}"
HEALTHY_LD_LIBRARY_PATH = "/usr/local/lib"
OTHER_MPI_LINKS = {  # name in <workdir>/other-mpi/bin -> Debian's Open MPI 4.1.4
    "mpirun": "/usr/bin/orterun",
    "mpiexec": "/usr/bin/orterun",
    "orterun": "/usr/bin/orterun",
    "orted": "/usr/bin/orted",
    "ompi_info": "/usr/bin/ompi_info",
}
_SSHD_READY_TIMEOUT = 10.0

_SSH_CONFIG_BLOCK = """\
Host {host.name}
    HostName {host.addr}
    User root
    Port 22
    IdentityFile {key}
    IdentitiesOnly yes
    UserKnownHostsFile {known_hosts}
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    UpdateHostKeys no
    BatchMode yes
    ConnectTimeout 5
"""

# sshd_config tokens may contain spaces, hence the quotes around paths and SetEnv values.
_SSHD_CONFIG = """\
# sshd for {host.name} in namespace {host.netns}
ListenAddress {host.addr}:22
HostKey "{key}"
PidFile "{pidfile}"
AuthorizedKeysFile "{authorized_keys}"
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
LogLevel ERROR
MaxStartups 200
MaxSessions 200
Subsystem sftp /usr/lib/openssh/sftp-server
SetEnv {setenv}
"""
# (MaxStartups/MaxSessions: fan-out checks and mpirun open many connections at once.)


class _WorkFile:
    """A file in the cluster's work directory, read as an attribute (``cluster.ssh_config``)."""

    def __init__(self, name: str, doc: str = "") -> None:
        self.name = name
        self.__doc__ = doc

    def __get__(self, cluster, owner=None):
        return self if cluster is None else cluster.workdir / self.name

    def __set__(self, cluster, value) -> None:
        raise AttributeError(f"{self.name} is a fixed file of the cluster's work directory")


class _Sshd(_ClusterBase):
    """The Cluster's SSH plumbing: files in its workdir and one sshd per host."""

    client_key = _WorkFile("client_ed25519")
    known_hosts = _WorkFile("known_hosts")
    ssh_config = _WorkFile("ssh_config")
    hostfile = _WorkFile("hostfile", "Open MPI style hostfile (``NAME slots=1`` per host).")
    authorized_keys = _WorkFile("authorized_keys")

    def _authorized_keys_of(self, host: Host) -> Path:
        """The host's own authorized_keys: the client key, refused from denied sources."""
        return self.workdir / f"authorized_keys_{host.name}"

    def _host_key(self, host: Host, alt: bool = False) -> Path:
        return self.workdir / f"hostkey_{host.name}{'_changed' if alt else ''}"

    def _sshd_config(self, host: Host) -> Path:
        return self.workdir / f"sshd_{host.name}.conf"

    def _sshd_pidfile(self, host: Host) -> Path:
        return self.workdir / f"sshd_{host.name}.pid"

    # -- keys and client files -----------------------------------------------------------
    def _start_keygens(self) -> list[subprocess.Popen]:
        keys = [self.client_key] + [self.workdir / f"hostkey_{name}" for name in self._names]
        return [self._keygen(key) for key in keys]

    def _keygen(self, key: Path) -> subprocess.Popen:
        return subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", key.name,
                                 "-f", str(key)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def _finish_keygens(procs: list[subprocess.Popen]) -> None:
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=_CMD_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise ClusterError(f"ssh-keygen timed out: {shlex.join(proc.args)}")
            if proc.returncode != 0:
                raise ClusterError(f"{shlex.join(proc.args)} failed: {err.strip()}")

    def _write_ssh_files(self) -> None:
        self.authorized_keys.write_text(Path(f"{self.client_key}.pub").read_text())
        self._write_authorized_keys()
        blocks = [_SSH_CONFIG_BLOCK.format(host=host, key=self.client_key, known_hosts=self.known_hosts)
                  for host in self.hosts]
        self.ssh_config.write_text(f"# namespace cluster {self.prefix}, made by tests/nscluster\n\n"
                                   + "\n".join(blocks))
        self.hostfile.write_text("".join(f"{h.name} slots=1\n" for h in self.hosts))
        self._write_known_hosts()

    def _write_authorized_keys(self) -> None:
        """One authorized_keys per host; ``from="!ADDR,*"`` refuses the key from denied sources."""
        key = self.authorized_keys.read_text().strip()
        for host in self.hosts:
            refused = sorted(self.host(src).addr for src, dst in self._denied if dst == host.name)
            opts = ('from="' + ",".join(f"!{a}" for a in refused) + ',*" ') if refused else ""
            path = self._authorized_keys_of(host)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(f"{opts}{key}\n")
            tmp.replace(path)

    def _write_known_hosts(self) -> None:
        lines = []
        for host in self.hosts:
            if "unknown_hostkey" in self._faults[host.name]:
                continue
            pub = Path(f"{self._host_key(host)}.pub").read_text().split()
            lines.append(f"{host.name},{host.addr} {pub[0]} {pub[1]}\n")
        self.known_hosts.write_text("".join(lines))

    # -- the server ----------------------------------------------------------------------
    def _host_env(self, host: Host) -> dict[str, str]:
        """The non-interactive environment sshd gives sessions on ``host`` (see module doc)."""
        faults = self._faults[host.name]
        path = BAD_PATH if "bad_path" in faults else HEALTHY_PATH
        if "other_mpi" in faults:
            path = f"{self._other_mpi_bin()}:{path}"
        env = {"PATH": path, "SHLVL": "1"}
        if "no_ld_library_path" not in faults:
            env["LD_LIBRARY_PATH"] = HEALTHY_LD_LIBRARY_PATH
        return env

    def _other_mpi_bin(self) -> Path:
        bindir = self.workdir / "other-mpi" / "bin"
        if not bindir.is_dir():
            bindir.mkdir(parents=True)
            for name, target in OTHER_MPI_LINKS.items():
                (bindir / name).symlink_to(target)
        return bindir

    def _write_sshd_config(self, host: Host) -> Path:
        faults = self._faults[host.name]
        key = self._host_key(host, alt="changed_hostkey" in faults)
        if not key.exists():
            self._finish_keygens([self._keygen(key)])
        setenv = " ".join(f'"{k}={v}"' for k, v in self._host_env(host).items())
        conf = self._sshd_config(host)
        conf.write_text(_SSHD_CONFIG.format(host=host, key=key, pidfile=self._sshd_pidfile(host),
                                            authorized_keys=self._authorized_keys_of(host),
                                            setenv=setenv))
        return conf

    def _sshd_argv(self, host: Host) -> list[str]:
        """sshd for ``host`` in its namespace; it daemonises (stdio -> /dev/null) after
        binding, then writes its PidFile."""
        self._sshd_pidfile(host).unlink(missing_ok=True)
        conf = self._write_sshd_config(host)
        log = self.workdir / f"sshd_{host.name}.log"
        return self._netns_argv(host, [SSHD, "-f", str(conf), "-E", str(log)])

    def _start_sshd(self, host: Host, *, wait: bool = True) -> None:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation dir
        _run(self._sshd_argv(host))
        if wait:
            self._wait_sshd([host])

    def _start_sshds(self, hosts: Sequence[Host]) -> None:
        """Start the hosts' sshd all at once (each daemonises after binding); bounded wait."""
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        procs = [subprocess.Popen(self._sshd_argv(host), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for host in hosts]
        deadline = time.monotonic() + _CMD_TIMEOUT
        failed = []
        for host, proc in zip(hosts, procs):
            try:
                _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                failed.append(f"{host.name}: sshd did not start within {_CMD_TIMEOUT:g} s")
                continue
            if proc.returncode != 0:
                failed.append(f"{host.name}: sshd exited {proc.returncode}: {err.strip()}")
        if failed:
            raise ClusterError("; ".join(failed))

    def _stop_sshd(self, host: Host) -> None:
        pidfile = self._sshd_pidfile(host)
        with contextlib.suppress(OSError, ValueError):
            _kill_and_wait([int(pidfile.read_text().split()[0])], signal.SIGTERM)
        pidfile.unlink(missing_ok=True)

    def _wait_sshd(self, hosts: Sequence[Host]) -> None:
        """Wait until each host's sshd answers with an SSH banner (bounded)."""
        deadline = time.monotonic() + _SSHD_READY_TIMEOUT
        pending = list(hosts)
        while pending:
            pending = [h for h in pending if not self._sshd_ready(h)]
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(h.name for h in pending)
                logs = "; ".join(f"{h.name}: {self._sshd_log_tail(h)}" for h in pending)
                raise ClusterError(f"sshd not ready after {_SSHD_READY_TIMEOUT:g} s on {names} ({logs})")
            time.sleep(0.02)

    def _sshd_ready(self, host: Host) -> bool:
        try:
            pid = int(self._sshd_pidfile(host).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        if not _pid_alive(pid):
            return False
        if "blackhole" in self._faults[host.name]:
            # Port 22 is dropped; look at the listening socket from inside instead.
            return _listening(pid, host.addr, 22)
        try:
            with socket.create_connection((host.addr, 22), timeout=0.5) as sock:
                sock.settimeout(1.0)
                return sock.recv(4).startswith(b"SSH-")
        except OSError:
            return False

    def _sshd_log_tail(self, host: Host) -> str:
        try:
            text = (self.workdir / f"sshd_{host.name}.log").read_text().strip()
        except OSError:
            return "no log"
        return text.splitlines()[-1] if text else "empty log"
