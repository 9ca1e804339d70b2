"""Exceptions of the checks, each carrying the cause and the fix for its host.

paramiko, socket and subprocess errors are translated into these where they are
caught (``checks/ssh.py``, ``checks/knownhosts.py``, ``checks/probesession.py``), so the
rest of the package never sees a library error and every failure reaches the user as
"host: cause — fix".
"""
from __future__ import annotations

from dtrun.launcher.errors import DtrunError


class CheckError(DtrunError):
    """A check could not be carried out on one host: what happened, and what to do."""

    def __init__(self, host: str, detail: str, fix: str = ""):
        self.host, self.detail, self.fix = host, detail, fix
        super().__init__(f"{host}: {detail}" + (f" — {fix}" if fix else ""))


class NameNotResolved(CheckError):
    """The host name has no address (DNS, /etc/hosts or the ssh config's HostName)."""


class ConnectRefused(CheckError):
    """The SSH port answered with a reset: the host is up, sshd is not listening."""


class ConnectTimeout(CheckError):
    """Nothing answered on the SSH port within the timeout: host down or packets dropped."""


class HostUnreachable(CheckError):
    """The kernel reported no route to the host."""


class SshProtocolError(CheckError):
    """TCP connected but the SSH handshake failed (no banner, no common algorithm, ...)."""


class AuthenticationError(CheckError):
    """No key was accepted, or the server wants a password or a second factor."""


class HostKeyUnknown(CheckError):
    """The host's key is in no known_hosts file: dtrun never accepts it silently."""


class HostKeyChanged(CheckError):
    """The host presented a different key from the one recorded: possibly an attack."""


class HostKeyRevoked(CheckError):
    """The host presented a key that a known_hosts file marks ``@revoked``: never accepted."""


class CheckTimeout(CheckError):
    """A remote step (probe, listener, connect) did not finish within its timeout."""


class RemoteCommandError(CheckError):
    """A remote command could not be run or gave output the check cannot read."""


class PreflightError(DtrunError):
    """dtrun refuses to launch: the preflight found a problem that would hang the job."""
