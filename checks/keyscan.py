"""``dtrun keyscan``: the safe form of ``ssh-keyscan HOST >> ~/.ssh/known_hosts``.

Fetches each host's key (SSH negotiation only, no login), shows its fingerprint,
and appends it to the known_hosts file the ssh config names only after the user
confirms (``--yes`` for scripts). A key that differs from a recorded one is never
replaced: that is the case where someone may be intercepting the connection.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional, TextIO

from dtrun.checks.errors import HostKeyChanged, HostKeyRevoked, HostKeyUnknown
from dtrun.checks.fanout import fan_out
from dtrun.checks.knownhosts import describe_key, known_host_keys, verify_host_key
from dtrun.checks.ssh import handshake, tcp_connect
from dtrun.checks.sshlib import import_paramiko
from dtrun.checks.sshtarget import load_ssh_config, ssh_config_path, ssh_target
from dtrun.launcher.errors import ExitCode, UsageError
from dtrun.launcher.hostfile import parse_host_list
from dtrun.launcher.hosts import HostOptions, is_local, resolve_hosts
from dtrun.launcher.safe import seconds


@dataclass(frozen=True, kw_only=True)
class KeyscanSpec:
    names: tuple[str, ...] = ()  # hosts given as arguments, instead of -H/--hostfile/--cluster
    hosts: HostOptions = HostOptions()
    timeout: float = 5.0
    yes: bool = False


def fetch_key(target, timeout: float):
    """The host key ``target`` presents (negotiation only; no authentication is attempted)."""
    paramiko = import_paramiko()
    sock = tcp_connect(target, timeout)
    transport = paramiko.Transport(sock)
    try:
        return handshake(transport, target, timeout)
    finally:
        transport.close()


def known_hosts_line(name: str, key) -> str:
    """One known_hosts line: ``name keytype base64`` (name already bracketed with a port)."""
    return f"{name} {key.get_name()} {key.get_base64()}\n"


def append_known_host(path: str, line: str) -> None:
    """Append one line, creating the file (0600) and its directory (0700) as ssh would."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        missing_newline = False
        if size:
            f.seek(size - 1)
            missing_newline = f.read(1) != b"\n"
        # A file without a final newline would merge the new entry into its last line.
        f.write((b"\n" if missing_newline else b"") + line.encode())


def _names(spec: KeyscanSpec):
    """The hosts to scan: the arguments, or those the host options select (with the selection)."""
    if spec.names:
        if spec.hosts.named:
            raise UsageError("give hosts either as arguments or with -H/--hostfile/--cluster, not both")
        return None, parse_host_list(",".join(spec.names), "keyscan")
    if not spec.hosts.named:
        raise UsageError("no hosts given: dtrun keyscan HOST... (or -H, --hostfile, --cluster)")
    selection = resolve_hosts(spec.hosts)
    return selection, list(selection.hosts)


def ask(question: str, stdin: Optional[TextIO], out: TextIO) -> bool:
    """Ask a yes/no question; a closed or unreadable stdin counts as "no"."""
    out.write(question)
    out.flush()
    try:
        answer = stdin.readline() if stdin is not None else ""
    except (OSError, ValueError):  # stdin closed (<&-) or not readable
        answer = ""
    if not answer:
        out.write("\n")
    return answer.strip().lower() in ("y", "yes")


def keyscan(spec: KeyscanSpec, stdin: Optional[TextIO] = None, out: Optional[TextIO] = None) -> int:
    """Fetch, show and (after confirmation) record each host's key; 0 when every host ends up known."""
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out
    seconds(spec.timeout, "--timeout")
    selection, hosts = _names(spec)
    cfg_path = ssh_config_path(spec.hosts.ssh_config, selection.ssh_config if selection else None)
    config = load_ssh_config(cfg_path)
    targets = [ssh_target(h, config, cfg_path) for h in hosts if not is_local(h.host)]
    keys = fan_out(targets, lambda t: fetch_key(t, spec.timeout))
    code = ExitCode.OK
    for t in targets:
        if t.name in keys.failed:
            err = keys.failed[t.name]
            print(f"{t.name}: {err.detail}; fix: {err.fix}", file=out)
            code = ExitCode.FAILED
            continue
        key = keys.ok[t.name]
        known_file, known = known_host_keys(t)
        where = f"{t.name} ({t.known_hosts_name})"
        try:
            verify_host_key(t, key, known_file, known)
            print(f"{where}: {describe_key(key)} already in {known_file}", file=out)
            continue
        except (HostKeyChanged, HostKeyRevoked) as exc:
            print(f"{t.name}: {exc.detail}; keyscan does not replace recorded keys. {exc.fix}", file=out)
            code = ExitCode.FAILED
            continue
        except HostKeyUnknown:
            pass
        dest = t.known_hosts[0]
        print(f"{where}: {describe_key(key)} — not yet known", file=out)
        if not (spec.yes or ask(f"add this key for {t.known_hosts_name} to {dest}? [y/N] ", stdin, out)):
            print(f"{t.name}: not added", file=out)
            code = ExitCode.FAILED
            continue
        append_known_host(dest, known_hosts_line(t.known_hosts_name, key))
        print(f"{t.name}: added to {dest}", file=out)
    return code
