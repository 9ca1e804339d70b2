"""A session with the doctor's probe on one host: starting it and talking to it in JSON lines.

The probe itself, the program that runs on the far host, is ``launcher/remote/probe.py``
(standard library only, so it runs where dtrun is not installed); its answer is parsed by
``checks/probereport.py``. This module is the local end in between. On a remote host the
probe runs over the host's existing SSH connection; on this machine it runs as a
subprocess. Either way it is the same fixed program: the command line is built here from
constant text and one quoted path (the job's Python, tried first so that its mpi4py can
be checked in place), and the probe's parameters travel as JSON on stdin, never as code
or shell text.
"""
from __future__ import annotations

import json
import os
import selectors
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

from dtrun.checks.errors import CheckTimeout, RemoteCommandError
from dtrun.launcher.remote import bundle

# One program holding the probe and the modules it imports (launcher.remote.bundle), so it runs
# on a host that has no copy of dtrun: the probe reports its host's stale Open MPI session
# directories with the code dtrun removes them with (sessiondirs).
PROBE_SOURCE = bundle("probe", ("procfs", "sessiondirs"))
# Reads the probe's source (length-prefixed) from stdin and runs it as __main__; the rest of
# stdin is left for the probe's JSON lines.
BOOT = ("import sys;b=sys.stdin.buffer;n=int(b.readline());"
        "exec(compile(b.read(n),'dtrun-remote-probe','exec'))")
NO_PYTHON_RC = 127


def boot_command(job_python: str) -> str:
    """The remote shell line: the job's Python if it exists there, else python3, else /usr/bin/python3.

    A host whose non-interactive PATH lacks the virtual environment (and maybe python3)
    still runs the probe through the fallbacks and reports what it found.
    """
    candidates = " ".join(shlex.quote(p) for p in (job_python, "python3", "/usr/bin/python3"))
    return (f"for p in {candidates}; do if command -v \"$p\" >/dev/null 2>&1; then "
            f"exec \"$p\" -c {shlex.quote(BOOT)}; fi; done; "
            f"echo \"dtrun probe: no python3 on PATH=$PATH nor /usr/bin/python3\" >&2; exit {NO_PYTHON_RC}")


def probe_input(request: dict) -> bytes:
    return str(len(PROBE_SOURCE)).encode() + b"\n" + PROBE_SOURCE + json.dumps(request).encode() + b"\n"


class ProbeSession:
    """A running probe: send a JSON line, read a JSON line before a deadline."""

    def __init__(self, host: str):
        self.host = host
        self._buf = bytearray()

    # transport-specific
    def _send(self, data: bytes) -> None: ...
    def _recv(self, timeout: float) -> Optional[bytes]: ...  # b"" at EOF, None on timeout
    def _stderr(self) -> str: ...
    def close(self) -> None: ...

    def send(self, obj: dict) -> None:
        self._send(json.dumps(obj).encode() + b"\n")

    def read(self, timeout: float, what: str) -> dict:
        """The next JSON line; CheckTimeout or RemoteCommandError naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckTimeout(self.host, f"the {what} did not answer within {timeout:g} s",
                                   f"log in to {self.host} and check its load and its Python")
            chunk = self._recv(left)
            if chunk is None:
                continue
            if not chunk:
                err = self._stderr().strip()
                raise RemoteCommandError(self.host, f"the {what} stopped without an answer" +
                                         (f": {err.splitlines()[-1]}" if err else ""),
                                         "see the env check of this host")
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        try:
            return json.loads(line)
        except ValueError:
            raise RemoteCommandError(self.host, f"the {what} printed something that is not JSON: {line[:200]!r}",
                                     "a login script that prints text breaks non-interactive sessions; "
                                     "make it print only for interactive shells") from None


class SshProbe(ProbeSession):
    def __init__(self, conn, request: dict, timeout: float):
        super().__init__(conn.target.name)
        self.chan = conn.open_channel(boot_command(request.get("paths", {}).get("python") or "python3"), timeout)
        self._send(probe_input(request))

    def _send(self, data: bytes) -> None:
        try:
            self.chan.sendall(data)
        except OSError as exc:
            raise RemoteCommandError(self.host, f"the probe's channel closed: {exc}", "") from None

    def _recv(self, timeout: float) -> Optional[bytes]:
        self.chan.settimeout(timeout)
        try:
            return self.chan.recv(65536)
        except socket.timeout:
            return None

    def _stderr(self) -> str:
        out = bytearray()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not (self.chan.exit_status_ready() and not self.chan.recv_stderr_ready()):
            if self.chan.recv_stderr_ready():
                out += self.chan.recv_stderr(65536)
            else:
                time.sleep(0.02)
        return out.decode("utf-8", "replace")

    def close(self) -> None:
        try:
            self.chan.shutdown_write()
            self.chan.close()
        except Exception:  # the channel may be gone with its host
            pass


class LocalProbe(ProbeSession):
    """The probe on this machine: a subprocess of this Python, in this environment."""

    def __init__(self, host: str, request: dict):
        super().__init__(host)
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, start_new_session=True)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._send(probe_input(request))

    def _send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def _recv(self, timeout: float) -> Optional[bytes]:
        if not self._sel.select(timeout):
            return None
        return os.read(self.proc.stdout.fileno(), 65536)

    def _stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode("utf-8", "replace")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._sel.close()
        self._err.close()
        self.proc.stdout.close()


def start_probe(host: str, conn: Optional[object], request: dict, timeout: float) -> ProbeSession:
    """The probe on ``host``: over ``conn`` (an SshConnection) or, for this machine, locally."""
    if conn is None:
        return LocalProbe(host, request)
    return SshProbe(conn, request, timeout)
