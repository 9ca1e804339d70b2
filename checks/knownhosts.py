"""The host key check, as OpenSSH makes it: known_hosts files read, the server's key compared.

``known_host_keys`` finds what the known_hosts files record for a target (hashed names,
wildcards, negations, ``@revoked`` keys); ``verify_host_key`` raises ``HostKeyUnknown``,
``HostKeyChanged`` or ``HostKeyRevoked`` unless the key presented is the one recorded.
Nothing here ever accepts a host key or turns checking off. It is apart from the
connection (``checks/ssh.py``) because keyscan uses it with a handshake only, no login.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from typing import Optional

from dtrun.checks.errors import HostKeyChanged, HostKeyRevoked, HostKeyUnknown
from dtrun.checks.sshlib import import_paramiko
from dtrun.checks.sshtarget import SshTarget


def fingerprint(key) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint of a paramiko key."""
    return key.fingerprint


def describe_key(key) -> str:
    return f"{key.get_name()} {fingerprint(key)}"


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


def prefer_known_types(transport, known: dict) -> None:
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

