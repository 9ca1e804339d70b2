"""The fast check dtrun runs before launching on several hosts.

SSH to every remote host (reachable, host key known and unchanged, key login with
no prompt) and the interfaces of every host (``ip -j addr`` over that connection),
from which the subnet every host shares is chosen, as ``dtrun doctor`` would. A
host that cannot be reached this way would make mpirun hang or stop at a prompt,
so dtrun refuses to launch and prints why (``--no-preflight`` skips all this). A
passing result (the interface choice, the expensive part) is cached for a few
minutes per host set; the cheap part, a TCP connection to every host's sshd that
must answer with its SSH banner, runs on every launch, so a host that went dark
since the last launch stops the launch within the timeout instead of hanging mpirun.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from checks.errors import CheckError, PreflightError
from checks.result import FAIL, Finding

CACHE_TTL_S = 300.0
TIMEOUT_S = 5.0
# Fixed text: nothing from the user reaches the remote shell. /usr/sbin for hosts whose PATH lacks it.
IP_ADDR_COMMAND = "PATH=\"$PATH:/usr/sbin:/sbin\" ip -j addr"


@dataclass(frozen=True)
class PreflightResult:
    findings: tuple[Finding, ...] = ()
    include: Optional[str] = None  # CIDR for MPI and its runtime
    nccl: Optional[str] = None  # NCCL_SOCKET_IFNAME value
    host_ifaces: tuple = ()  # (host, ((iface, addr/prefix), ...)) for every remote host

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.status == FAIL]


def _cache_dir() -> Path:
    from launcher.paths import cache_dir as dtrun_cache

    return dtrun_cache() / "preflight"


def cache_key(hosts, ssh_config: Optional[str]) -> str:
    """Key of a host set: names and per-host ssh settings, and the ssh config file's identity."""
    try:
        st = os.stat(ssh_config) if ssh_config else None
    except OSError:
        st = None
    data = [[h.host, h.user, h.port, h.identity_file] for h in hosts]
    data.append([ssh_config, st.st_mtime_ns if st else None, st.st_size if st else None])
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:24]


def read_cache(key: str, now: Optional[float] = None) -> Optional[PreflightResult]:
    try:
        data = json.loads((_cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("time", 0), (int, float)):
        return None  # not a cache entry dtrun wrote: ignore it, the next good preflight replaces it
    if (now or time.time()) - data.get("time", 0) > CACHE_TTL_S:
        return None
    try:
        ifaces = tuple((str(h), tuple((str(n), str(a)) for n, a in items)) for h, items in data.get("host_ifaces", ()))
    except (TypeError, ValueError):
        return None
    return PreflightResult((), data.get("include"), data.get("nccl"), ifaces)


def write_cache(key: str, result: PreflightResult) -> None:
    from launcher.paths import atomic_write

    path = _cache_dir() / f"{key}.json"
    try:
        atomic_write(path, json.dumps({"time": time.time(), "include": result.include, "nccl": result.nccl,
                                       "host_ifaces": result.host_ifaces}))
    except OSError:
        pass  # a read-only cache costs the next launch another preflight


def check(hosts, ssh_config: Optional[str], timeout: float = TIMEOUT_S) -> PreflightResult:
    """SSH to every remote host and pick the shared subnet; never raises for a host's problem."""
    from checks import network, ssh
    from launcher.hosts import is_local

    config = ssh.load_ssh_config(ssh_config)
    remote = [h for h in hosts if not is_local(h.host)]
    targets = [ssh.ssh_target(h, config, ssh_config) for h in remote]
    conns = ssh.connect_all(targets, timeout)
    findings, ifaces, reached = conns.findings("ssh"), {}, {}
    for name, conn in conns.ok.items():
        try:
            rc, out, _ = conn.run(IP_ADDR_COMMAND, timeout)
            if rc == 0:
                ifaces[name] = network.parse_ip_json(out)
                reached[name] = conn.transport.getpeername()[0]
        except (CheckError, ValueError):
            pass  # no interface list: the launch falls back to dtrun's local inference
        finally:
            conn.close()
    if findings or len(ifaces) < len(remote):
        return PreflightResult(tuple(findings))
    host_ifaces = tuple((name, tuple((i.name, str(n)) for i in found for n in i.networks))
                        for name, found in ifaces.items())
    mine = network.local_interfaces()
    launcher = mine
    for h in hosts:
        if is_local(h.host):
            ifaces[h.host], launcher = mine, None
    rec = network.recommend(ifaces, launcher, reached)
    if rec is None or not rec.launcher_on_it:
        return PreflightResult(tuple(findings), host_ifaces=host_ifaces)
    return PreflightResult(tuple(findings), rec.cidr, rec.nccl_socket_ifname, host_ifaces)


def _ssh_banner(target, timeout: float) -> str:
    """Connect to the host's sshd and read its banner line: the cheap proof that it is alive."""
    from checks import ssh
    from checks.errors import SshProtocolError

    sock = ssh.tcp_connect(target, timeout)
    try:
        sock.settimeout(timeout)
        data = b""
        deadline = time.monotonic() + timeout
        while b"\n" not in data and len(data) < 1024 and time.monotonic() < deadline:
            chunk = sock.recv(256)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    finally:
        sock.close()
    if not data.startswith(b"SSH-"):
        raise SshProtocolError(
            target.name, f"{target.where} accepted TCP but sent no SSH banner within {timeout:g} s: sshd is hung, "
                         f"or something else listens on port {target.port}",
            f"restart sshd on {target.name}, or check the Port in the ssh config")
    return data.decode("ascii", "replace").strip()


def reachable(hosts, ssh_config: Optional[str], timeout: float = TIMEOUT_S) -> tuple[Finding, ...]:
    """A finding for every remote host whose sshd does not answer within ``timeout`` (all in parallel)."""
    from checks import ssh
    from launcher.hosts import is_local

    config = ssh.load_ssh_config(ssh_config)
    targets = [ssh.ssh_target(h, config, ssh_config) for h in hosts if not is_local(h.host)]
    return tuple(ssh.fan_out(targets, lambda t: _ssh_banner(t, timeout)).findings("ssh"))


def choice_of(result: PreflightResult):
    """The interface choice a passing result makes (``launcher.netinfo.InterfaceChoice``), or None."""
    from launcher.netinfo import InterfaceChoice

    if not result.include and not result.host_ifaces:
        return None
    reason = f"subnet {result.include} shared by all hosts, found by the preflight" if result.include else ""
    return InterfaceChoice(result.include, result.nccl, reason, result.host_ifaces)


def preflight(opts, selection, flavor, environ: Optional[Mapping[str, str]] = None):
    """Check the hosts of a launch (cached); return the interface choice (``InterfaceChoice``) or None.

    The caller applies the choice (``launch.make_spec``); the options are left as they are.

    Raises:
        PreflightError: a host cannot be reached over ssh without a prompt (the finding is printed).
    """
    from checks.ssh import ssh_config_path

    environ = os.environ if environ is None else environ
    cfg = ssh_config_path(opts.ssh_config, selection.ssh_config, environ)
    key = cache_key(selection.hosts, cfg)
    result = read_cache(key)
    if result is not None:
        dark = reachable(selection.hosts, cfg)
        if dark:
            result = PreflightResult(dark)
    else:
        result = check(selection.hosts, cfg)
        if not result.failed and not getattr(opts, "dry_run", False):  # a dry run changes nothing on disk
            write_cache(key, result)
    if result.failed:
        for f in result.failed:
            print(f"dtrun: preflight: {f.message}", file=sys.stderr)
        n = len({f.host for f in result.failed})
        raise PreflightError(
            f"preflight: {n} host{'s' if n != 1 else ''} cannot be reached over ssh without a prompt, so mpirun "
            f"would hang or fail; `dtrun doctor` with the same host options runs the full checklist, "
            f"--no-preflight launches anyway")
    return choice_of(result)
