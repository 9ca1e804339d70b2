"""One SSH connection per host, opened the way OpenSSH would, with every failure told apart.

``ssh_target`` reads the ssh config (Host/HostName/User/Port/IdentityFile/
IdentitiesOnly/UserKnownHostsFile/HostKeyAlias) into a frozen ``SshTarget``;
``connect`` then resolves the name, opens TCP to the port, negotiates, checks
the host key against known_hosts and authenticates with keys only, each step
under its own timeout, and raises one ``checks.errors`` exception naming the
cause and the fix. Unknown host keys are rejected and changed ones reported
loudly; nothing here ever accepts a host key or turns checking off.

paramiko is imported inside the functions that need it, through ``import_paramiko``.
"""
from __future__ import annotations

import errno
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dtrun.checks.errors import (
    AuthenticationError,
    CheckTimeout,
    ConnectRefused,
    ConnectTimeout,
    HostKeyChanged,
    HostKeyRevoked,
    HostKeyUnknown,
    HostUnreachable,
    NameNotResolved,
    RemoteCommandError,
    SshProtocolError,
)

DEFAULT_TIMEOUT_S = 5.0
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


def import_paramiko():
    """paramiko, without the 80 ms import of invoke that paramiko.config makes only for ``Match exec``.

    dtrun does not evaluate ``Match exec`` (``ssh_target`` says so if a config uses it), so
    ``import invoke`` is made to fail while paramiko loads, which paramiko.config tolerates.
    """
    if "paramiko" in sys.modules or "invoke" in sys.modules:
        import paramiko

        return paramiko
    sys.modules["invoke"] = None  # type: ignore[assignment]  # import invoke -> ImportError
    try:
        import paramiko
    finally:
        del sys.modules["invoke"]  # anyone else importing invoke later gets the real one
    # paramiko's transport threads log their own failures (a closed socket after a handshake that
    # timed out prints a traceback through logging's last-resort handler); dtrun reports each one itself.
    import logging

    logging.getLogger("paramiko").addHandler(logging.NullHandler())
    return paramiko


def default_ssh_config() -> Optional[str]:
    path = os.path.expanduser("~/.ssh/config")
    return path if os.path.isfile(path) else None


def ssh_config_path(given: Optional[str], from_cluster_file: Optional[str] = None, environ=None) -> Optional[str]:
    """The launch's rule (``launcher.sshconf.base_ssh_config``), else ~/.ssh/config.

    Raises:
        UsageError: an empty --ssh-config, or the file named does not exist.
    """
    from dtrun.launcher.sshconf import base_ssh_config

    return base_ssh_config(given, from_cluster_file, os.environ if environ is None else environ) \
        or default_ssh_config()


def load_ssh_config(path: Optional[str]):
    """A ``paramiko.SSHConfig`` for ``path`` (an empty one for None)."""
    paramiko = import_paramiko()

    from dtrun.launcher.errors import UsageError

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
    from dtrun.launcher.errors import UsageError

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
    import getpass

    return getpass.getuser()


def fingerprint(key) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint of a paramiko key."""
    return key.fingerprint


def describe_key(key) -> str:
    return f"{key.get_name()} {fingerprint(key)}"


# ---- known_hosts -------------------------------------------------------------------------------

@dataclass(frozen=True)
class KnownHostsFile:
    """One known_hosts file as OpenSSH reads it: plain entries, ``@revoked`` keys, and lines skipped."""

    keys: object  # paramiko.HostKeys
    revoked: tuple = ()  # (name patterns, key)
    skipped: tuple[str, ...] = ()  # "path:line: why" for lines not understood


def read_known_hosts(path: str) -> KnownHostsFile:
    """Parse ``path`` line by line; a line that cannot be read is skipped (as OpenSSH does), never fatal.

    ``@cert-authority`` lines are skipped with a note (dtrun does not verify host
    certificates); ``@revoked`` keys are kept so that a host presenting one is refused.
    """
    paramiko = import_paramiko()
    from paramiko.hostkeys import HostKeyEntry

    keys, revoked, skipped = paramiko.HostKeys(), [], []
    try:
        with open(path, "rb") as f:
            data = f.read(16 << 20)
    except OSError:
        return KnownHostsFile(keys)
    for lineno, raw in enumerate(data.splitlines(), 1):
        line = raw.decode("utf-8", "replace").strip()
        if not line or line.startswith("#"):
            continue
        marker = None
        if line.startswith("@"):
            marker, _, line = line.partition(" ")
            line = line.strip()
        try:
            entry = HostKeyEntry.from_line(line, lineno)
        except Exception:  # noqa: BLE001 - paramiko raises SSHException, InvalidHostKey, ValueError,
            entry = None  # OverflowError, ... on damaged key data; OpenSSH skips such lines, and so does dtrun
        if entry is None:
            skipped.append(f"{path}:{lineno}: not a known_hosts entry dtrun can read")
            continue
        if marker == "@revoked":
            revoked.append((tuple(entry.hostnames), entry.key))
        elif marker == "@cert-authority":
            skipped.append(f"{path}:{lineno}: @cert-authority (host certificates are not checked by dtrun)")
        elif marker is not None:
            skipped.append(f"{path}:{lineno}: unknown marker {marker}")
        else:
            for h in entry.hostnames:
                keys.add(h, entry.key.get_name(), entry.key)
    return KnownHostsFile(keys, tuple(revoked), tuple(skipped))


def _name_matches(name: str, patterns) -> bool:
    """OpenSSH's host-pattern match for a known_hosts line: hashed names, wildcards, '!' negation."""
    import fnmatch

    paramiko = import_paramiko()
    hit = False
    for p in patterns:
        if p.startswith("|1|"):
            try:
                if paramiko.HostKeys.hash_host(name, p) == p:
                    hit = True
            except (ValueError, TypeError, IndexError):  # a damaged hash: no match
                continue
        elif p.startswith("!"):
            if fnmatch.fnmatchcase(name, p[1:]):
                return False
        elif fnmatch.fnmatchcase(name, p):
            hit = True
    return hit


def revoked_key_file(target: SshTarget, key) -> Optional[str]:
    """The known_hosts file that marks ``key`` ``@revoked`` for this host, if one does."""
    for path in target.known_hosts + target.global_known_hosts:
        for patterns, bad in read_known_hosts(path).revoked:
            if bad == key and _name_matches(target.known_hosts_name, patterns):
                return path
    return None


def known_host_keys(target: SshTarget):
    """(file, {keytype: key}) of the first known_hosts file that lists the host, else (None, {})."""
    name = target.known_hosts_name
    for path in target.known_hosts + target.global_known_hosts:
        if not os.path.isfile(path):
            continue
        found = read_known_hosts(path).keys.lookup(name)
        if found:
            return path, {k: found[k] for k in found.keys()}
    return None, {}


def _prefer_known_types(transport, known: dict) -> None:
    """Ask for a host key type we already know (as OpenSSH and paramiko's SSHClient do)."""
    if not known:
        return
    opts = transport.get_security_options()
    wanted = []
    for kt in known:
        wanted += ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"] if kt == "ssh-rsa" else [kt]
    offered = list(opts.key_types)
    first = [k for k in wanted if k in offered]
    opts.key_types = first + [k for k in offered if k not in first]


def verify_host_key(target: SshTarget, server_key, known_file: Optional[str], known: dict) -> None:
    """Raise HostKeyUnknown / HostKeyChanged unless ``server_key`` is recorded for the host."""
    keyscan = "dtrun keyscan" + (f" --ssh-config {target.config}" if target.config else "") + f" {target.name}"
    revoked_in = revoked_key_file(target, server_key)
    if revoked_in:
        raise HostKeyRevoked(
            target.name,
            f"{target.known_hosts_name} presents {describe_key(server_key)}, which {revoked_in} marks @revoked; "
            f"dtrun will not connect",
            f"the host must get a new host key; ask its administrator (the revoked key may have been stolen)",
        )
    if not known:
        files = ", ".join(target.known_hosts)
        raise HostKeyUnknown(
            target.name,
            f"host key of {target.known_hosts_name} ({describe_key(server_key)}) is not in {files}; "
            f"ssh and mpirun would stop at a yes/no prompt or refuse",
            f"check the fingerprint with the host's administrator, then run `{keyscan}`",
        )
    recorded = known.get(server_key.get_name())
    if recorded is None and len(known) == 1 and server_key.get_name().startswith("ssh-rsa"):
        recorded = next(iter(known.values()))
    if recorded is not None and recorded == server_key:
        return
    old = recorded if recorded is not None else next(iter(known.values()))
    raise HostKeyChanged(
        target.name,
        f"HOST KEY CHANGED: {target.known_hosts_name} presents {describe_key(server_key)} but {known_file} "
        f"records {describe_key(old)} — someone may be intercepting the connection, or the host was reinstalled; "
        f"dtrun will not connect",
        f"verify the new key out of band; only if the host was really reinstalled, remove the old entry "
        f"(ssh-keygen -R '{target.known_hosts_name}' -f {known_file}) and run `{keyscan}`",
    )


# ---- connecting --------------------------------------------------------------------------------

def resolve(target: SshTarget, timeout: float) -> list:
    """getaddrinfo under a timeout (a dead DNS server must not hold the host's slot forever)."""
    result: list = []
    error: list = []

    def work():
        try:
            result.extend(socket.getaddrinfo(target.hostname, target.port, type=socket.SOCK_STREAM))
        except OSError as exc:
            error.append(exc)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(timeout)
    via = f" (HostName {target.hostname} from {target.config})" if target.hostname != target.name else ""
    if t.is_alive():
        raise NameNotResolved(target.name, f"resolving {target.hostname}{via} took more than {timeout:g} s",
                              "check the DNS servers in /etc/resolv.conf, or add the host to /etc/hosts")
    if error or not result:
        raise NameNotResolved(target.name, f"name {target.hostname}{via} does not resolve",
                              "fix the spelling, add it to /etc/hosts or DNS, or give HostName in the ssh config")
    # IPv4 first: the clusters this targets name hosts by IPv4, and a dead IPv6 route only costs time.
    return sorted(result, key=lambda ai: ai[0] != socket.AF_INET)


def tcp_connect(target: SshTarget, timeout: float) -> socket.socket:
    """A connected socket to the SSH port, or the reason there is none."""
    last = None
    for family, socktype, proto, _, addr in resolve(target, timeout):
        sock = socket.socket(family, socktype, proto)
        sock.settimeout(timeout)
        try:
            sock.connect(addr)
            return sock
        except socket.timeout:
            sock.close()
            raise ConnectTimeout(
                target.name,
                f"TCP to {target.name} ({addr[0]}:{target.port}) timed out after {timeout:g} s: the host is down, or a firewall "
                f"drops SSH packets",
                f"check that {target.name} is up (ping, console) and that its firewall allows TCP port {target.port}",
            ) from None
        except ConnectionRefusedError:
            sock.close()
            raise ConnectRefused(
                target.name,
                f"TCP to {target.name} ({addr[0]}:{target.port}) refused: the host is up but sshd is not listening on port {target.port}",
                f"start sshd on {target.name} (systemctl start ssh), or give the right Port in the ssh config",
            ) from None
        except OSError as exc:
            sock.close()
            last = (addr, exc)
    addr, exc = last
    code = errno.errorcode.get(exc.errno, "")
    raise HostUnreachable(
        target.name,
        f"TCP to {target.name} ({addr[0]}:{target.port}) failed: {exc.strerror or exc} ({code}): no route to the host",
        f"check that {target.name} is up and that this host has a route to {addr[0]}",
    )


def _keys_to_try(target: SshTarget):
    """(label, key) pairs in OpenSSH's order: agent, then identity files; skipped files with reasons."""
    paramiko = import_paramiko()

    skipped = []
    keys = []
    if not target.identities_only and os.environ.get("SSH_AUTH_SOCK"):
        try:
            keys += [(f"agent key {k.fingerprint}", k) for k in paramiko.Agent().get_keys()]
        except paramiko.SSHException:
            skipped.append("the ssh agent did not answer")
    files = target.identity_files or tuple(os.path.expanduser(p) for p in DEFAULT_IDENTITIES)
    for path in files:
        if not os.path.isfile(path):
            if target.identity_files:
                skipped.append(f"{path} does not exist")
            continue
        try:
            keys.append((path, paramiko.PKey.from_path(path)))
        except paramiko.PasswordRequiredException:
            skipped.append(f"{path} is protected by a passphrase (load it into ssh-agent: ssh-add {path})")
        except (paramiko.SSHException, OSError, ValueError) as exc:
            skipped.append(f"{path} cannot be read ({exc})")
    return keys, skipped


def authenticate(transport, target: SshTarget) -> str:
    """Public-key authentication only: returns which key worked; never prompts."""
    paramiko = import_paramiko()

    keys, skipped = _keys_to_try(target)
    tried = []
    for label, key in keys:
        try:
            rest = transport.auth_publickey(target.user, key)
        except paramiko.BadAuthenticationType as exc:
            raise AuthenticationError(
                target.name,
                f"{target.user}@{target.name} does not accept keys (server allows: {', '.join(exc.allowed_types)}); "
                f"mpirun cannot type a password",
                f"enable PubkeyAuthentication on {target.name} and install your public key there (ssh-copy-id)",
            ) from None
        except paramiko.AuthenticationException:
            tried.append(label)
            continue
        except paramiko.SSHException as exc:
            raise SshProtocolError(target.name, f"authentication as {target.user} failed: {exc}",
                                   "run `ssh -v` to that host to see where it stops") from None
        if rest:
            raise AuthenticationError(
                target.name,
                f"{target.user}@{target.name} accepted {label} but then asks for {', '.join(rest)} "
                f"(a second factor): mpirun cannot answer prompts",
                f"allow key-only login for {target.user} from this network on {target.name}",
            )
        return label
    detail = f"no key was accepted for {target.user}@{target.name}"
    detail += f" (tried: {', '.join(tried)})" if tried else " (no key to try)"
    if skipped:
        detail += "; " + "; ".join(skipped)
    raise AuthenticationError(
        target.name, detail + "; ssh would ask for a password, which mpirun cannot give",
        f"install your public key on {target.name} (ssh-copy-id {target.user}@{target.name}) or set IdentityFile "
        f"in the ssh config",
    )


@dataclass
class SshConnection:
    """An authenticated connection to one host, reused by all of that host's checks."""

    target: SshTarget
    transport: object
    key_label: str = ""
    host_key: str = ""
    timings: dict = field(default_factory=dict)

    def open_channel(self, command: str, timeout: float):
        """Start ``command`` (one line for the remote shell) and return the paramiko channel."""
        paramiko = import_paramiko()

        try:
            chan = self.transport.open_session(timeout=timeout)
            chan.settimeout(timeout)
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise RemoteCommandError(self.target.name, f"cannot start a command over SSH: {exc}",
                                     f"check MaxSessions and the login shell of {self.target.user} on {self.target.name}") from None
        return chan

    def run(self, command: str, timeout: float, stdin: bytes = b"") -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of one remote command, bounded by ``timeout``."""
        chan = self.open_channel(command, timeout)
        try:
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            out, err = read_until_exit(chan, time.monotonic() + timeout, self.target.name)
            return chan.recv_exit_status(), out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        finally:
            chan.close()

    def close(self) -> None:
        try:
            self.transport.close()
        except Exception:  # closing a half-dead transport must not hide the real finding
            pass


def read_until_exit(chan, deadline: float, host: str) -> tuple[bytes, bytes]:
    import select

    out, err = bytearray(), bytearray()
    while True:
        while chan.recv_ready():
            out += chan.recv(65536)
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
        if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
            if chan.eof_received:
                return bytes(out), bytes(err)
        left = deadline - time.monotonic()
        if left <= 0:
            raise CheckTimeout(host, "remote command did not finish in time", "see the other findings for this host")
        select.select([chan], [], [], min(left, 0.5))


def handshake(transport, target: SshTarget, timeout: float):
    """SSH negotiation on a connected transport, bounded by ``timeout``; returns the server's host key.

    Raises:
        SshProtocolError: no greeting, no common algorithm, or no key exchange in time.
    """
    paramiko = import_paramiko()

    transport.banner_timeout = timeout
    try:
        transport.start_client(timeout=timeout)
    except (paramiko.SSHException, EOFError, OSError) as exc:
        what = str(exc) or type(exc).__name__
        if "banner" in what.lower() or isinstance(exc, (EOFError, socket.timeout)):
            raise SshProtocolError(
                target.name,
                f"TCP to {target.where} connected but no SSH greeting came within {timeout:g} s ({what}): "
                f"sshd is overloaded, or something else listens on port {target.port}",
                f"check sshd on {target.name} (journalctl -u ssh) and MaxStartups",
            ) from None
        raise SshProtocolError(target.name, f"SSH negotiation with {target.where} failed: {what}",
                               "compare the ciphers and key types of this ssh client and the host's sshd") from None
    return negotiated_key(transport, target, timeout)


def negotiated_key(transport, target: SshTarget, timeout: float):
    """The server's host key after ``start_client``, which can return on its timeout without raising."""
    paramiko = import_paramiko()

    try:
        key = transport.get_remote_server_key()  # raises "No existing session" until the key exchange is done
    except paramiko.SSHException:
        key = None
    if key is None:
        raise SshProtocolError(
            target.name,
            f"TCP to {target.where} connected but the SSH handshake did not complete within {timeout:g} s: sshd is "
            f"overloaded or hung, or something else listens on port {target.port}",
            f"check sshd on {target.name} (journalctl -u ssh) and MaxStartups",
        )
    return key


def connect(target: SshTarget, timeout: float = DEFAULT_TIMEOUT_S) -> SshConnection:
    """TCP connect, SSH negotiation, host key check and key authentication, each timed.

    Raises:
        NameNotResolved, ConnectRefused, ConnectTimeout, HostUnreachable, SshProtocolError,
        HostKeyUnknown, HostKeyChanged, AuthenticationError: each with the cause and the fix.
    """
    paramiko = import_paramiko()

    t0 = time.monotonic()
    sock = tcp_connect(target, timeout)
    t_tcp = time.monotonic()
    known_file, known = known_host_keys(target)
    transport = paramiko.Transport(sock)
    ok = False
    try:
        transport.auth_timeout = timeout
        _prefer_known_types(transport, known)
        server_key = handshake(transport, target, timeout)
        verify_host_key(target, server_key, known_file, known)
        t_kex = time.monotonic()
        label = authenticate(transport, target)
        ok = True
    finally:
        if not ok:
            transport.close()
    t_auth = time.monotonic()
    return SshConnection(target, transport, label, describe_key(server_key),
                         {"tcp": t_tcp - t0, "kex": t_kex - t_tcp, "auth": t_auth - t_kex, "total": t_auth - t0})


def fan_out(items: Sequence, work, workers: int = 32, key=lambda item: item.name):
    """``work(item)`` for every item (a target, a host) in parallel, never stopping at a failure.

    Returns:
        ``HostResults``: ``ok`` holds each result and ``failed`` each ``CheckError`` raised,
        keyed by ``key(item)`` (the host's name).
    """
    from concurrent.futures import ThreadPoolExecutor

    from dtrun.checks.errors import CheckError
    from dtrun.checks.result import HostResults

    def one(item):
        try:
            return True, work(item)
        except CheckError as exc:
            return False, exc

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items)))) as pool:
        answers = list(pool.map(one, items))
    ok, failed = {}, {}
    for item, (fine, value) in zip(items, answers):
        (ok if fine else failed)[key(item)] = value
    return HostResults(ok, failed)


def connect_all(targets: Sequence[SshTarget], timeout: float):
    """Connect to every target in parallel: ``HostResults`` of SshConnection / CheckError."""
    return fan_out(targets, lambda t: connect(t, timeout))
