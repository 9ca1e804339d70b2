"""Teardown and leftovers, from names alone, so that any process can clean up a cluster.

Namespaces (``dtrun-<prefix>-hN``), links (``dtbr-<prefix>``, ``dtv-<prefix>-N``),
/etc/hosts lines and root iptables rules (``MARKER:<prefix>``), the cluster's own sshd
and ssh processes (their command line names its workdir) and the workdir itself.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Sequence

from .common import (BRIDGE_PREFIX, MARKER, NETNS_PREFIX, STATE_DIR, VETH_PREFIX, _PREFIX_RE, _cmdline,
                     _kill_and_wait, _pids_with_cmdline)
from .namespaces import (_delete_iptables_rules, _edit_hosts, _hosts_lines, _ip_batch, _iptables_rules,
                         _link_names, _netns_list, _netns_pids)


def _teardown(*, prefix: str | None, workdir: Path | None, bridge: str | None,
              netns: Sequence[str], veths: Sequence[str]) -> list[str]:
    """Remove a cluster's pieces; return what is still there afterwards."""
    existing_ns = set(_netns_list())
    doomed = [ns for ns in netns if ns in existing_ns]
    pids = [pid for ns in doomed for pid in _netns_pids(ns)]
    if workdir is not None:
        pids += _pids_with_cmdline(f"{workdir}/")
    _kill_and_wait(sorted(set(pids)))
    links = set(_link_names())
    _ip_batch([f"link del {v}" for v in veths if v in links]
              + ([f"link del {bridge}"] if bridge and bridge in links else [])
              + [f"netns del {ns}" for ns in doomed], force=True)
    marker = f"{MARKER}:{prefix}" if prefix else f"{MARKER}:"
    if _hosts_lines(marker):
        _edit_hosts(marker)
    _delete_iptables_rules(marker)
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
        if prefix:
            (STATE_DIR / f"{prefix}.json").unlink(missing_ok=True)
    return leftovers(prefix)


def leftovers(prefix: str | None = None) -> list[str]:
    """What a cluster (or, with no prefix, any dtrun test cluster) left on this machine."""
    found = []
    ns_start = f"{NETNS_PREFIX}{prefix}-" if prefix else NETNS_PREFIX
    found += [f"netns {ns}" for ns in _netns_list() if ns.startswith(ns_start)]
    link_starts = ((f"{BRIDGE_PREFIX}{prefix}", f"{VETH_PREFIX}{prefix}-") if prefix
                   else (BRIDGE_PREFIX, VETH_PREFIX))
    found += [f"link {name}" for name in _link_names()
              if name == link_starts[0] or name.startswith(link_starts[1])
              or (not prefix and name.startswith(link_starts[0]))]
    marker = f"{MARKER}:{prefix}" if prefix else f"{MARKER}:"
    found += [f"/etc/hosts line {line!r}" for line in _hosts_lines(marker)]
    found += [f"iptables rule {shlex.join(rule)}" for rule in _iptables_rules(marker)]
    where = f"{STATE_DIR / prefix}/" if prefix else f"{STATE_DIR}/"
    found += [f"process {pid} ({_cmdline(pid)})" for pid in _pids_with_cmdline(where)]
    if prefix and (STATE_DIR / prefix).exists():
        found.append(f"workdir {STATE_DIR / prefix}")
    return found


def down_prefix(prefix: str) -> list[str]:
    """Remove one cluster's pieces found by name alone (no state file needed); return leftovers."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix {prefix!r} must match {_PREFIX_RE.pattern}")
    netns = [ns for ns in _netns_list() if ns.startswith(f"{NETNS_PREFIX}{prefix}-")]
    veths = [name for name in _link_names() if name.startswith(f"{VETH_PREFIX}{prefix}-")]
    return _teardown(prefix=prefix, workdir=STATE_DIR / prefix, bridge=f"{BRIDGE_PREFIX}{prefix}",
                     netns=netns, veths=veths)


def down_all() -> list[str]:
    """Remove every dtrun test cluster on this machine (any process's); return leftovers."""
    netns = [ns for ns in _netns_list() if ns.startswith(NETNS_PREFIX)]
    links = [name for name in _link_names() if name.startswith((BRIDGE_PREFIX, VETH_PREFIX))]
    _teardown(prefix=None, workdir=None, bridge=None, netns=netns,
              veths=[name for name in links])
    _kill_and_wait(_pids_with_cmdline(f"{STATE_DIR}/"))
    if STATE_DIR.is_dir():
        for entry in STATE_DIR.iterdir():
            if entry.name == ".lock":
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    return leftovers()
