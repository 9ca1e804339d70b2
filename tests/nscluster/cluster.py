"""``Cluster``: N namespace hosts on one bridge, each with its own hostname and sshd.

The class holds a cluster's names, faults and lifecycle; its namespace plumbing, sshd
plumbing, fault switches and state file come from the mixins of ``namespaces``, ``sshd``,
``faults`` and ``state``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import subprocess
from typing import Mapping, Sequence

from .common import (BRIDGE_PREFIX, NETNS_PREFIX, STATE_DIR, _MAX_HOSTS, _PREFIX_RE, ClusterError,
                     ClusterUnavailable, Host, _locked)
from .faults import _NETNS_FAULTS, CLUSTER_FAULTS, HOST_FAULTS, _Faults
from .namespaces import (_Namespaces, _edit_hosts, _netns_list, _pick_subnet, _raise_neigh_limits,
                         cluster_unavailable_reason)
from .sshd import _Sshd
from .state import _State
from .teardown import _teardown

_LIVE: dict[str, "Cluster"] = {}  # clusters up in this process, torn down at exit
CREATED_PREFIXES: list[str] = []  # every prefix this process brought up (leftover checks)


def _down_live_clusters() -> None:
    for cluster in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            cluster.down()


atexit.register(_down_live_clusters)


class Cluster(_Namespaces, _Sshd, _Faults, _State):
    """N namespace hosts on one bridge, each with its own hostname and sshd.

    Args:
        n: number of hosts (1..99), named ``<prefix>-h1`` .. ``<prefix>-h<n>``.
        faults: host -> set of fault names (see ``HOST_FAULTS`` and the ``faults``
            module). A host is given as a 0-based index into ``hosts``, its full name,
            or its short name ``"h2"``.
        cluster_faults: faults applied to every host (``{"docker0"}``).
        prefix: name prefix (``[a-z][a-z0-9]{1,7}``); random ``dtXXXX`` by default.
        deny_ssh: (source, destination) host pairs: the client key is not authorised on
            the destination when the connection comes from the source (an inner host of
            Open MPI's tree spawn whose key its child does not accept). ssh from this
            machine and from every other host still works.
    """

    def __init__(self, n: int, *, faults: Mapping[int | str, set[str]] | None = None,
                 cluster_faults: set[str] | frozenset[str] = frozenset(),
                 prefix: str | None = None,
                 deny_ssh: Sequence[tuple[int | str, int | str]] = ()) -> None:
        if not 1 <= n <= _MAX_HOSTS:
            raise ValueError(f"a cluster has 1..{_MAX_HOSTS} hosts, not {n}")
        if prefix is None:
            prefix = self._fresh_prefix()
        elif not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r} must match {_PREFIX_RE.pattern}")
        unknown = set(cluster_faults) - CLUSTER_FAULTS
        if unknown:
            raise ValueError(f"unknown cluster faults {sorted(unknown)}; known: {sorted(CLUSTER_FAULTS)}")
        self.prefix = prefix
        self.n = n
        self.workdir = STATE_DIR / prefix
        self.state_file = STATE_DIR / f"{prefix}.json"
        self.bridge = f"{BRIDGE_PREFIX}{prefix}"
        self.subnet = ""
        self.gateway = ""
        self.hosts: list[Host] = []
        self.origin = "library"
        self.cluster_faults = frozenset(cluster_faults)
        # Host names are known before up(); addresses once the subnet is chosen.
        self._names = [f"{prefix}-h{i}" for i in range(1, n + 1)]
        self._faults: dict[str, set[str]] = {name: set(cluster_faults) for name in self._names}
        for key, names in (faults or {}).items():
            name = self._resolve_name(key)
            bad = set(names) - HOST_FAULTS
            if bad:
                raise ValueError(f"{name}: unknown faults {sorted(bad)}; known: {sorted(HOST_FAULTS)}")
            self._faults[name] |= set(names)
        self._denied: set[tuple[str, str]] = set()
        for src, dst in deny_ssh:
            self._denied.add(self._ssh_pair(src, dst))
        self._is_up = False

    # -- lookup --------------------------------------------------------------------------
    def _resolve_name(self, key: int | str | Host) -> str:
        if isinstance(key, Host):
            key = key.name
        if isinstance(key, int) and not isinstance(key, bool):
            if not -self.n <= key < self.n:
                raise KeyError(f"host index {key} out of range for {self.n} hosts")
            return self._names[key]
        if isinstance(key, str):
            if key in self._names:
                return key
            full = f"{self.prefix}-{key}"
            if full in self._names:
                return full
        raise KeyError(f"no host {key!r} in cluster {self.prefix} ({', '.join(self._names)})")

    def _ssh_pair(self, src: int | str | Host, dst: int | str | Host) -> tuple[str, str]:
        pair = (self._resolve_name(src), self._resolve_name(dst))
        if pair[0] == pair[1]:
            raise ValueError(f"deny_ssh {pair[0]} -> itself: name two different hosts")
        return pair

    def host(self, i_or_name: int | str | Host) -> Host:
        """A host by 0-based index, full name, or short name (``"h2"``)."""
        if not self.hosts:
            raise ClusterError(f"cluster {self.prefix} is not up")
        return self.hosts[self._names.index(self._resolve_name(i_or_name))]

    def faults_of(self, host: int | str | Host) -> frozenset[str]:
        return frozenset(self._faults[self._resolve_name(host)])

    @property
    def faults(self) -> dict[str, frozenset[str]]:
        return {name: frozenset(f) for name, f in self._faults.items()}

    @property
    def denied_ssh(self) -> frozenset[tuple[str, str]]:
        """(source, destination) host-name pairs whose host-to-host ssh is refused."""
        return frozenset(self._denied)

    def deny_ssh(self, src: int | str | Host, dst: int | str | Host, deny: bool = True) -> None:
        """Refuse (or, with deny=False, allow again) ssh from ``src`` into ``dst`` (running or not)."""
        pair = self._ssh_pair(src, dst)
        (self._denied.add if deny else self._denied.discard)(pair)
        if self._is_up:
            self._write_authorized_keys()  # sshd reads the file at each login: no restart
            self._write_state()

    def __repr__(self) -> str:
        return f"Cluster({self.n}, prefix={self.prefix!r}, subnet={self.subnet!r}, up={self._is_up})"

    # -- lifecycle -----------------------------------------------------------------------
    @staticmethod
    def _fresh_prefix() -> str:
        existing = set(_netns_list())
        for _ in range(100):
            prefix = "dt" + secrets.token_hex(2)
            if not (STATE_DIR / prefix).exists() and f"{NETNS_PREFIX}{prefix}-h1" not in existing:
                return prefix
        raise ClusterError("could not find an unused cluster prefix")

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc_info) -> None:
        self.down()

    def up(self) -> "Cluster":
        """Create the hosts and start their sshd; on any failure tear everything down and raise."""
        if self._is_up:
            return self
        reason = cluster_unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        # Claim the prefix atomically (mkdir) before making anything: a failed up() tears
        # down by name and must never hit someone else's cluster.
        in_use = f"{NETNS_PREFIX}{self._names[0]}" in _netns_list()
        try:
            if not in_use:
                self.workdir.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            in_use = True
        if in_use:
            raise ClusterError(f"prefix {self.prefix!r} is in use ({self.workdir} or its namespaces exist)")
        _LIVE[self.prefix] = self
        CREATED_PREFIXES.append(self.prefix)
        try:
            self._up()
        except BaseException:
            # Also on KeyboardInterrupt / SystemExit from a SIGTERM handler.
            self.down()
            raise
        self._is_up = True
        return self

    def _up(self) -> None:
        keygens = self._start_keygens()
        with _locked():
            net = _pick_subnet()
            self.subnet = str(net)
            addrs = list(net.hosts())
            self.gateway = str(addrs[0])
            self.hosts = [Host(name, str(addrs[10 + i]), f"{NETNS_PREFIX}{name}")
                          for i, name in enumerate(self._names)]
            self._write_state()  # before creating anything, so a crash leaves a trail
            self._create_bridge(net)
        self._create_hosts(net.prefixlen)
        _edit_hosts(self._hosts_marker,
                    [f"{h.addr}\t{h.name}\t# {self._hosts_marker}" for h in self.hosts])
        self._open_root_firewall()
        self._finish_keygens(keygens)
        self._write_ssh_files()
        _raise_neigh_limits()
        starting = [h for h in self.hosts if "dead" not in self._faults[h.name]]
        self._start_sshds(starting)
        self._wait_sshd(starting)
        for host in self.hosts:
            if self._faults[host.name] & _NETNS_FAULTS:  # a new host has none of them
                self._apply_netns_faults(host)

    def down(self) -> None:
        """Remove everything up() made. Safe to call at any point, and more than once."""
        _LIVE.pop(self.prefix, None)
        self._is_up = False
        errors = _teardown(prefix=self.prefix, workdir=self.workdir, bridge=self.bridge,
                           netns=[f"{NETNS_PREFIX}{name}" for name in self._names],
                           veths=[self._veth(i) for i in range(1, self.n + 1)])
        if errors:
            raise ClusterError(f"teardown of cluster {self.prefix} left: {'; '.join(errors)}")

    def detach(self) -> None:
        """Keep this cluster after the interpreter exits (the CLI's ``up``)."""
        _LIVE.pop(self.prefix, None)
        self.origin = "cli"
        self._write_state()

    # -- running things on hosts ---------------------------------------------------------
    def exec(self, host: int | str | Host, argv: Sequence[str], *, timeout: float = 30,
             check: bool = False, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run argv inside the host's namespace under its hostname; text output captured.

        ``env`` entries are added to (and override) this process's environment.
        Raises subprocess.TimeoutExpired / CalledProcessError like subprocess.run.
        """
        h = self.host(host)
        full_env = {**os.environ, **env} if env is not None else None
        proc = subprocess.run(self._netns_argv(h, argv), capture_output=True, text=True,
                              timeout=timeout, env=full_env, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, list(argv), proc.stdout, proc.stderr)
        return proc

    def popen(self, host: int | str | Host, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start argv in the background inside the host's namespace under its hostname.

        The Popen's pid is argv's own process (``ip netns exec``, ``unshare`` and ``sh``
        all exec). down() kills anything still running in the namespace.
        """
        h = self.host(host)
        return subprocess.Popen(self._netns_argv(h, argv), **popen_kwargs)

    def ssh_argv(self, host: int | str | Host) -> list[str]:
        return ["ssh", "-F", str(self.ssh_config), self.host(host).name]
