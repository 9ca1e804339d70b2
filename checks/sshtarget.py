"""Where and as whom to connect to each host: the ssh config read into a frozen ``SshTarget``.

``ssh_target`` reads the ssh config (Host/HostName/User/Port/IdentityFile/IdentitiesOnly/
UserKnownHostsFile/GlobalKnownHostsFile/HostKeyAlias) as OpenSSH would, with the settings a
cluster file gives for the host winning. It is separate from the connection
(``checks/ssh.py``) because it needs no network: the preflight, the host check and
keyscan read targets before anything connects, and a bad config is a usage error here.
"""
from __future__ import annotations

import getpass
import os
from dataclasses import dataclass
from typing import Optional

from dtrun.checks.sshlib import import_paramiko
from dtrun.launcher.errors import UsageError
from dtrun.launcher.sshconf import base_ssh_config

DEFAULT_KNOWN_HOSTS = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
DEFAULT_IDENTITIES = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")


@dataclass(frozen=True)
class SshTarget:
    """Where and as whom to connect for one host of the job, after the ssh config."""

    name: str  # as the user wrote it (-H, hostfile)
    hostname: str  # after HostName
    port: int = 22
    user: str = ""
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    known_hosts: tuple[str, ...] = DEFAULT_KNOWN_HOSTS
    global_known_hosts: tuple[str, ...] = GLOBAL_KNOWN_HOSTS
    host_key_alias: Optional[str] = None
    config: Optional[str] = None  # the ssh config file used, for messages and fixes

    @property
    def known_hosts_name(self) -> str:
        """The name OpenSSH files this host's key under: HostKeyAlias, else HostName, with [ ]:port."""
        name = self.host_key_alias or self.hostname
        return name if self.port == 22 else f"[{name}]:{self.port}"

    @property
    def where(self) -> str:
        """"h3 (10.0.0.3:22)": the name the user knows and where it leads."""
        return f"{self.name} ({self.hostname}:{self.port})"

def default_ssh_config() -> Optional[str]:
    path = os.path.expanduser("~/.ssh/config")
    return path if os.path.isfile(path) else None


def ssh_config_path(given: Optional[str], from_cluster_file: Optional[str] = None, environ=None) -> Optional[str]:
    """The launch's rule (``launcher.sshconf.base_ssh_config``), else ~/.ssh/config.

    Raises:
        UsageError: an empty --ssh-config, or the file named does not exist.
    """
    return base_ssh_config(given, from_cluster_file, os.environ if environ is None else environ) \
        or default_ssh_config()


def load_ssh_config(path: Optional[str]):
    """A ``paramiko.SSHConfig`` for ``path`` (an empty one for None)."""
    paramiko = import_paramiko()
    if not path:
        return paramiko.SSHConfig()
    try:
        with open(path, "rb") as f:
            data = f.read(4 << 20)
        text = data.decode("utf-8")
        if "\0" in text:
            raise UnicodeDecodeError("utf-8", data, text.index("\0"), text.index("\0") + 1, "NUL byte")
        return paramiko.SSHConfig.from_text(text)
    except OSError as exc:
        raise UsageError(f"ssh config {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"ssh config {path}: not a text file (binary content); give an OpenSSH client config") from None
    except (paramiko.SSHException, ValueError, IndexError) as exc:  # ConfigParseError: e.g. a bare ProxyJump
        raise UsageError(f"ssh config {path}: cannot parse it ({exc}); `ssh -G -F {path} HOST` shows what OpenSSH "
                         f"makes of it") from None


def ssh_target(host, config=None, config_path: Optional[str] = None) -> SshTarget:
    """Resolve one ``HostSlots`` (or a bare name) through a parsed ssh config.

    Settings a cluster file gives for the host (user, port, identity_file) win over
    the ssh config, as they do in the config dtrun writes for mpirun.
    """
    name = getattr(host, "host", host)
    try:
        opts = config.lookup(name) if config is not None else {}
    except ImportError:  # paramiko needs invoke for 'Match exec'
        raise UsageError(f"ssh config {config_path}: 'Match exec' is not supported by dtrun's ssh checks") from None
    except (ValueError, KeyError, TypeError, IndexError) as exc:  # paramiko on values it cannot expand
        raise UsageError(f"ssh config {config_path}: cannot read the settings for {name} ({exc})") from None
    user = getattr(host, "user", None) or opts.get("user") or _local_user()
    port_text = str(getattr(host, "port", None) or opts.get("port") or 22)
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UsageError(f"ssh config {config_path}: Port {port_text!r} for {name} is not a port number (1-65535)")
    port = int(port_text)
    ids = opts.get("identityfile", ())
    ids = tuple(ids) if isinstance(ids, (list, tuple)) else (str(ids),)
    own = getattr(host, "identity_file", None)
    if own:
        ids = (own,) + ids
    known = tuple(opts["userknownhostsfile"].split()) if opts.get("userknownhostsfile") else DEFAULT_KNOWN_HOSTS
    known_global = (tuple(opts["globalknownhostsfile"].split()) if opts.get("globalknownhostsfile")
                    else GLOBAL_KNOWN_HOSTS)
    return SshTarget(
        name=name,
        hostname=opts.get("hostname") or name,
        port=port,
        user=user,
        identity_files=tuple(os.path.expanduser(i) for i in ids),
        identities_only=str(opts.get("identitiesonly", "no")).lower() == "yes",
        known_hosts=tuple(os.path.expanduser(k) for k in known),
        global_known_hosts=tuple(os.path.expanduser(k) for k in known_global),
        host_key_alias=opts.get("hostkeyalias"),
        config=config_path,
    )


def _local_user() -> str:
    return getpass.getuser()

