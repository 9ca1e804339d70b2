"""One SSH connection per host, opened the way OpenSSH would, with every failure told apart.

Given an ``SshTarget`` (``checks/sshtarget.py``: the ssh config already read), ``connect``
resolves the name, opens TCP to the port, negotiates, checks the host key against
known_hosts (``checks/knownhosts.py``) and authenticates with keys only, each step under
its own timeout, and raises one ``checks.errors`` exception naming the cause and the fix.

paramiko is imported inside the functions that need it, through ``checks.sshlib.import_paramiko``.
"""
from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from dtrun.checks.errors import (
    AuthenticationError,
    CheckTimeout,
    ConnectRefused,
    ConnectTimeout,
    HostUnreachable,
    NameNotResolved,
    RemoteCommandError,
    SshProtocolError,
)
from dtrun.checks.fanout import fan_out
from dtrun.checks.knownhosts import describe_key, known_host_keys, prefer_known_types, verify_host_key
from dtrun.checks.sshlib import import_paramiko
from dtrun.checks.sshtarget import DEFAULT_IDENTITIES, SshTarget

DEFAULT_TIMEOUT_S = 5.0


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
    """Read a channel's stdout and stderr until the command exits, or raise CheckTimeout at ``deadline``."""
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
        prefer_known_types(transport, known)
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


def connect_all(targets: Sequence[SshTarget], timeout: float):
    """Connect to every target in parallel: ``HostResults`` of SshConnection / CheckError."""
    return fan_out(targets, lambda t: connect(t, timeout))
