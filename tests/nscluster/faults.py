"""The faults a host can carry, and how each is applied to (or removed from) a running host.

    docker0: a bridge ``docker0`` with 172.17.0.1/16, up, inside the host.
    firewall: INPUT accepts tcp/22 and ESTABLISHED,RELATED, drops all other TCP.
    dead: no sshd on the host; connecting to port 22 is refused at once.
    blackhole: INPUT drops tcp/22, so connecting times out.
    bad_path: non-interactive PATH is ``/usr/bin:/bin`` (no virtual environment).
    no_ld_library_path: LD_LIBRARY_PATH unset in the non-interactive environment.
    changed_hostkey: sshd serves a key other than the one in ``known_hosts``.
    unknown_hostkey: the host is missing from ``known_hosts``.
    other_mpi: bare ``mpirun``/``mpiexec`` resolve to Debian's Open MPI 4.1.4.
    slow_link: ``tc qdisc replace dev eth0 root tbf rate 50mbit burst 32kbit latency
        400ms``: everything the host sends leaves at 50 Mb/s (a slow NIC among fast ones).

The environment faults (bad_path, no_ld_library_path, other_mpi) and the host-key faults
are sshd settings (see ``sshd``); the rest live inside the host's namespace.
"""

from __future__ import annotations

import shutil

from .common import Host, _ClusterBase, _run
from .namespaces import _ip_batch

HOST_FAULTS = frozenset({
    "docker0", "firewall", "dead", "blackhole", "bad_path", "no_ld_library_path",
    "changed_hostkey", "unknown_hostkey", "other_mpi", "slow_link",
})
CLUSTER_FAULTS = frozenset({"docker0"})
FAULTS = HOST_FAULTS
_IPTABLES_FAULTS = frozenset({"firewall", "blackhole"})
_NETNS_FAULTS = frozenset({"docker0", "slow_link"}) | _IPTABLES_FAULTS  # set up inside the namespace
# slow_link: a token bucket on the host's eth0 (egress), as tbf is in this kernel and netem is not.
SLOW_LINK_TBF = ("tbf", "rate", "50mbit", "burst", "32kbit", "latency", "400ms")
_SSHD_FAULTS = frozenset({"bad_path", "no_ld_library_path", "other_mpi", "changed_hostkey"})


class _Faults(_ClusterBase):
    """The Cluster's fault switches: add_fault / remove_fault on a running cluster."""

    def _apply_netns_faults(self, host: Host) -> None:
        """Bring docker0 and the host's iptables INPUT chain in line with its faults."""
        faults = self._faults[host.name]
        has_docker0 = any(line.split(":")[1].strip().split("@")[0] == "docker0"
                          for line in _run(["ip", "-n", host.netns, "-o", "link", "show"]).stdout.splitlines())
        if "docker0" in faults and not has_docker0:
            # What Docker's daemon leaves on a node: a bridge with 172.17.0.1/16, up, no ports.
            _ip_batch(["link add docker0 type bridge",
                       "addr add 172.17.0.1/16 dev docker0",
                       "link set docker0 up"], netns=host.netns)
        elif "docker0" not in faults and has_docker0:
            _ip_batch(["link del docker0"], netns=host.netns)
        self._apply_iptables(host)
        self._apply_tc(host)

    def _apply_tc(self, host: Host) -> None:
        tc = ["ip", "netns", "exec", host.netns, "tc", "qdisc"]
        if "slow_link" in self._faults[host.name]:
            _run(tc + ["replace", "dev", "eth0", "root", *SLOW_LINK_TBF])
        elif "tbf" in _run(tc + ["show", "dev", "eth0"], check=False).stdout:
            _run(tc + ["del", "dev", "eth0", "root"], check=False)

    def _apply_iptables(self, host: Host) -> None:
        faults = self._faults[host.name]
        wanted: list[list[str]] = []
        if "blackhole" in faults:
            wanted.append(["-p", "tcp", "--dport", "22", "-j", "DROP"])
        if "firewall" in faults:
            wanted += [["-p", "tcp", "--dport", "22", "-j", "ACCEPT"],
                       ["-p", "tcp", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                       ["-p", "tcp", "-j", "DROP"]]
        ipt = ["ip", "netns", "exec", host.netns, "iptables", "-w", "5"]
        current = _run(ipt + ["-S", "INPUT"], check=False).stdout if shutil.which("iptables") else ""
        if not wanted and "-A INPUT" not in current:
            return
        _run(ipt + ["-F", "INPUT"])
        for rule in wanted:
            _run(ipt + ["-A", "INPUT"] + rule)

    def add_fault(self, host: int | str | Host, fault: str) -> None:
        """Apply a fault to a running cluster (also fine before up())."""
        self._change_fault(host, fault, add=True)

    def remove_fault(self, host: int | str | Host, fault: str) -> None:
        """Undo a fault on a running cluster; the host behaves as healthy again for it."""
        self._change_fault(host, fault, add=False)

    def _change_fault(self, key: int | str | Host, fault: str, *, add: bool) -> None:
        if fault not in HOST_FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {sorted(HOST_FAULTS)}")
        name = self._resolve_name(key)
        if (fault in self._faults[name]) == add:
            return
        (self._faults[name].add if add else self._faults[name].discard)(fault)
        if not self._is_up:
            return
        host = self.host(name)
        if fault in _NETNS_FAULTS:
            self._apply_netns_faults(host)
        elif fault == "unknown_hostkey":
            self._write_known_hosts()
        elif fault == "dead":
            self._stop_sshd(host) if add else self._start_sshd(host)
        elif fault in _SSHD_FAULTS and "dead" not in self._faults[name]:
            self._stop_sshd(host)
            self._start_sshd(host)
        self._write_state()
