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
A cached result is used only when it passes the checks a fresh one does (``validate_entry``)
and its file is private to this user; otherwise a note says why and the hosts are checked again.
"""
from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import secrets
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from dtrun.checks.errors import CheckError, PreflightError, SshProtocolError
from dtrun.checks.result import FAIL, Finding
from dtrun.launcher import safe
from dtrun.launcher.errors import InvalidValue
from dtrun.launcher.hosts import is_local
from dtrun.launcher.netinfo import InterfaceChoice
from dtrun.launcher.paths import cache_dir as dtrun_cache

CACHE_TTL_S = 300.0
CLOCK_SKEW_S = 60.0  # a cache entry stamped later than this from now was not written by this clock
MAX_CACHE_BYTES = 1 << 20
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


class BadCacheEntry(ValueError):
    """A cache file dtrun must not use (the reason is the message); the hosts are checked afresh."""


def _private_dir(path: Path) -> None:
    """Raise BadCacheEntry unless ``path`` is a real directory of this user that no one else can write."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise BadCacheEntry(f"{path} is not a directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise BadCacheEntry(f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: "
                            f"only a directory of this user that others cannot write is trusted")


def _read_private(path: Path) -> str:
    """The text of a cache file this user owns and only this user can write (never through a symlink)."""
    _private_dir(path.parent)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise BadCacheEntry("not a regular file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise BadCacheEntry(f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: only a file "
                                f"of this user that others cannot write is trusted")
        data = f.read(MAX_CACHE_BYTES + 1)
    if len(data) > MAX_CACHE_BYTES:
        raise BadCacheEntry(f"larger than {MAX_CACHE_BYTES} bytes")
    return data.decode("utf-8")


def _is_str(value) -> bool:
    return isinstance(value, str)


def _subnet(value: str) -> "ipaddress.IPv4Network":
    """A subnet as the preflight writes one: IPv4 CIDR in its normal form (``10.0.0.0/24``)."""
    if not _is_str(value) or "/" not in value or safe.iface(value, "include") != value:
        raise BadCacheEntry(f"include {value!r} is not a subnet in CIDR form")
    net = ipaddress.ip_network(value)
    if net.version != 4:
        raise BadCacheEntry(f"include {value!r} is not an IPv4 subnet")
    return net


def _iface_name(value) -> str:
    try:
        if _is_str(value) and "/" not in value and safe.iface(value, "interface") == value:
            return value
    except safe.InvalidValue:
        pass
    raise BadCacheEntry(f"interface name {value!r} is not a plain interface name")


def validate_entry(data, remote_hosts: Optional[tuple] = None, local_ifaces=None,
                   now: Optional[float] = None) -> PreflightResult:
    """The cached result, checked as strictly as a fresh one would be; raises BadCacheEntry otherwise.

    Args:
        remote_hosts: the names of the launch's remote hosts: the entry must describe
            exactly these (a fresh preflight lists the interfaces of every one).
        local_ifaces: this machine's interfaces (or a function that reads them, called only
            when there is a subnet to check): the subnet must be on one of them, as a fresh
            preflight requires (mpirun's daemons call back to this host).

    Every value read here reaches mpirun's command line (the subnet, NCCL_SOCKET_IFNAME,
    Hydra's -iface), so each one must pass the grammar the command line itself uses, and
    the subnet must be one that every host listed has an address on.
    """
    if not isinstance(data, dict) or set(data) != {"time", "include", "nccl", "host_ifaces"}:
        raise BadCacheEntry("not a preflight result dtrun wrote")
    _check_age(data["time"], now)
    try:
        host_ifaces = _host_ifaces(data["host_ifaces"])
        names = [h for h, _ in host_ifaces]
        if len(set(names)) != len(names):
            raise BadCacheEntry("a host is listed twice")
        if remote_hosts is not None and host_ifaces and set(names) != set(remote_hosts):
            raise BadCacheEntry(f"it lists hosts {', '.join(sorted(names))}, not this launch's")
        include, nccl = data["include"], data["nccl"]
        if include is None:
            if nccl is not None:
                raise BadCacheEntry("NCCL_SOCKET_IFNAME without a subnet")
            return PreflightResult((), None, None, tuple(host_ifaces))
        net = _subnet(include)
        if remote_hosts is not None and not host_ifaces:
            raise BadCacheEntry(f"subnet {include} without the hosts' interfaces")
        _check_subnet_and_nccl(include, net, nccl, host_ifaces, local_ifaces)
        return PreflightResult((), include, nccl, tuple(host_ifaces))
    except (InvalidValue, ValueError, TypeError) as exc:
        if isinstance(exc, BadCacheEntry):
            raise
        raise BadCacheEntry(str(exc)) from None


def _check_age(stamp, now: Optional[float]) -> None:
    """The entry's time stamp: a number, not older than CACHE_TTL_S, not in the future."""
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or stamp != stamp:
        raise BadCacheEntry(f"time {stamp!r} is not a number")
    age = (time.time() if now is None else now) - stamp
    if age > CACHE_TTL_S:
        raise BadCacheEntry("expired")
    if age < -CLOCK_SKEW_S:
        raise BadCacheEntry("written in the future")


def _host_ifaces(rows) -> list[tuple[str, tuple]]:
    """[(host, ((interface, address/prefix), ...)), ...] from the entry's ``host_ifaces``, each value checked."""
    if not isinstance(rows, list):
        raise BadCacheEntry("host_ifaces is not a list")
    host_ifaces = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 2 and _is_str(row[0]) and isinstance(row[1], list)):
            raise BadCacheEntry(f"host_ifaces entry {row!r} is not [host, [[interface, address], ...]]")
        items = []
        for item in row[1]:
            if not (isinstance(item, list) and len(item) == 2 and _is_str(item[1])):
                raise BadCacheEntry(f"{row[0]}: interface entry {item!r} is not [interface, address/prefix]")
            addr = ipaddress.ip_interface(item[1])
            if addr.version != 4 or str(addr) != item[1]:
                raise BadCacheEntry(f"{row[0]}: {item[1]!r} is not an IPv4 address/prefix")
            items.append((_iface_name(item[0]), item[1]))
        host_ifaces.append((row[0], tuple(items)))
    return host_ifaces


def _check_subnet_and_nccl(include: str, net, nccl, host_ifaces, local_ifaces) -> None:
    """The subnet is on every host listed and on this one; NCCL_SOCKET_IFNAME names its interfaces."""
    on_it = set()
    for host, items in host_ifaces:
        here = {name for name, a in items if ipaddress.ip_interface(a).ip in net}
        if not here:
            raise BadCacheEntry(f"subnet {include} is not on {host}")
        on_it |= here
    mine = local_ifaces() if callable(local_ifaces) else local_ifaces
    if mine is not None and not any(n.ip in net for i in mine for n in i.networks):
        raise BadCacheEntry(f"subnet {include} is not on this host")
    if not _is_str(nccl):
        raise BadCacheEntry(f"NCCL_SOCKET_IFNAME {nccl!r} is not text")
    given = nccl[1:] if nccl.startswith("=") else nccl
    listed = {_iface_name(n) for n in given.split(",")}
    if not on_it <= listed or (nccl.startswith("=") and len(listed) != 1):
        raise BadCacheEntry(f"NCCL_SOCKET_IFNAME {nccl!r} does not name the interfaces on {include}")


def cache_path(key: str) -> Path:
    return _cache_dir() / f"{key}.json"


def read_cache(key: str, now: Optional[float] = None, remote_hosts: Optional[tuple] = None, local_ifaces=None,
               note=None) -> Optional[PreflightResult]:
    """The cached result for ``key``, or None: missing, expired, or not trusted (``note`` gets why).

    A cached value is used only when it passes the checks a fresh one does (``validate_entry``)
    and the file is this user's own and writable by no one else.
    """
    path = cache_path(key)
    try:
        data = json.loads(_read_private(path))
        return validate_entry(data, remote_hosts, local_ifaces, now)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        reason = str(exc) if isinstance(exc, BadCacheEntry) else f"unreadable ({exc.__class__.__name__})"
        if note is not None and reason != "expired":
            note(f"preflight: cached result {path} ignored ({reason}); checking the hosts again")
        return None


def write_cache(key: str, result: PreflightResult) -> None:
    """Keep a passing result, in a file only this user can read, in a directory only this user can write."""
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _private_dir(path.parent)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"time": time.time(), "include": result.include, "nccl": result.nccl,
                                    "host_ifaces": result.host_ifaces}))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, BadCacheEntry):
        pass  # a read-only or untrusted cache directory costs the next launch another preflight


def check(hosts, ssh_config: Optional[str], timeout: float = TIMEOUT_S) -> PreflightResult:
    """SSH to every remote host and pick the shared subnet; never raises for a host's problem."""
    from dtrun.checks import network, ssh, sshtarget  # lazy: multi-host launches only; every launch imports this module

    config = sshtarget.load_ssh_config(ssh_config)
    remote = [h for h in hosts if not is_local(h.host)]
    targets = [sshtarget.ssh_target(h, config, ssh_config) for h in remote]
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
    from dtrun.checks.ssh import tcp_connect  # lazy: multi-host launches only; every launch imports this module

    sock = tcp_connect(target, timeout)
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
    from dtrun.checks import fanout, sshtarget  # lazy: multi-host launches and failed jobs only; every launch imports this module

    config = sshtarget.load_ssh_config(ssh_config)
    targets = [sshtarget.ssh_target(h, config, ssh_config) for h in hosts if not is_local(h.host)]
    return tuple(fanout.fan_out(targets, lambda t: _ssh_banner(t, timeout)).findings("ssh"))


def choice_of(result: PreflightResult):
    """The interface choice a passing result makes (``launcher.netinfo.InterfaceChoice``), or None."""
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
    from dtrun.checks.sshtarget import ssh_config_path  # lazy: multi-host launches only; every launch imports this module
    from dtrun.launcher.interfaces import local_interfaces  # lazy: multi-host launches only; every launch imports this module

    environ = os.environ if environ is None else environ
    cfg = ssh_config_path(opts.hosts.ssh_config, selection.ssh_config, environ)
    key = cache_key(selection.hosts, cfg)
    remote = tuple(h.host for h in selection.hosts if not is_local(h.host))
    result = read_cache(key, remote_hosts=remote, local_ifaces=local_interfaces,
                        note=lambda text: print(f"dtrun: {text}", file=sys.stderr))
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
