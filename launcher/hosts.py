"""From the user's host options to the list of hosts a job runs on.

Merges duplicates, applies --include/--exclude, falls back to Slurm and then
to localhost, and settles -np. Pure except for reading the named files.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Mapping, Optional, Sequence

from dtrun.launcher.errors import HostfileError, UnknownHostError, UsageError
from dtrun.launcher.hostfile import (
    HostSlots,
    parse_host_list,
    read_cluster_file,
    read_hostfile,
    slurm_hosts,
)
from dtrun.launcher.safe import MAX_RANKS, count


SLURM_SOURCE = "Slurm allocation"  # HostSelection.source of hosts read from the allocation


@dataclass(frozen=True)
class HostSelection:
    """The resolved hosts of a job, where they came from, and warnings to show."""

    hosts: tuple[HostSlots, ...]
    source: str
    warnings: tuple[str, ...] = ()
    ssh_config: Optional[str] = None

    @property
    def total_slots(self) -> int:
        return sum(h.slots for h in self.hosts)

    @property
    def names(self) -> list[str]:
        return [h.host for h in self.hosts]


@dataclass(frozen=True, kw_only=True)
class HostOptions:
    """The options that choose the hosts, as typed: -H, --hostfile, --cluster, --include,
    --exclude, and --ssh-config (how to reach them). Every command that takes hosts embeds
    one; ``resolve_hosts`` turns it into a ``HostSelection``."""

    host_list: Optional[str] = None
    hostfile: Optional[str] = None
    cluster: Optional[str] = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    ssh_config: Optional[str] = None

    @property
    def named(self) -> bool:
        """Whether a host source was named (-H, --hostfile or --cluster)."""
        return bool(self.host_list or self.hostfile or self.cluster)


@lru_cache(maxsize=None)
def local_names() -> frozenset[str]:
    """Names that mean "this machine" without asking DNS."""
    name = socket.gethostname()
    return frozenset({"localhost", "127.0.0.1", "::1", name, name.split(".")[0]})


def is_local(host: str) -> bool:
    return host in local_names() or host.startswith("127.")


def all_local(hosts: Sequence[HostSlots]) -> bool:
    return all(is_local(h.host) for h in hosts)


def merge_duplicates(hosts: Sequence[HostSlots]) -> tuple[list[HostSlots], list[str]]:
    """Merge repeated hosts by adding their slots; return the hosts and one warning per merge."""
    merged: dict[str, HostSlots] = {}
    warnings = []
    for h in hosts:
        prev = merged.get(h.host)
        if prev is None:
            merged[h.host] = h
            continue
        total = prev.slots + h.slots
        max_slots = None
        if prev.max_slots is not None or h.max_slots is not None:
            max_slots = (prev.max_slots or prev.slots) + (h.max_slots or h.slots)
        merged[h.host] = replace(prev, slots=total, max_slots=max_slots)
        where = f" ({prev.source} and {h.source})" if prev.source != h.source else ""
        warnings.append(f"host {h.host} is listed more than once{where}; merged into {total} slots")
    return list(merged.values()), warnings


def _split_names(values: Sequence[str]) -> list[str]:
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def select_hosts(hosts: Sequence[HostSlots], include: Sequence[str], exclude: Sequence[str]) -> list[HostSlots]:
    """Keep the hosts named by --include (all if none), then drop those named by --exclude."""
    known = {h.host for h in hosts}
    inc, exc = _split_names(include), _split_names(exclude)
    for flag, names in (("--include", inc), ("--exclude", exc)):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UnknownHostError(
                f"{flag}: {', '.join(unknown)} not in the host list ({', '.join(sorted(known))})"
            )
    chosen = [h for h in hosts if (not inc or h.host in inc) and h.host not in exc]
    if not chosen:
        raise UsageError("--include/--exclude left no hosts")
    return chosen


def resolve_hosts(options: HostOptions = HostOptions(), environ: Optional[Mapping[str, str]] = None) -> HostSelection:
    """Resolve the job's hosts: -H, --hostfile, --cluster, else Slurm, else localhost.

    Raises:
        UsageError: more than one host source, or a source that is malformed.
    """
    environ = os.environ if environ is None else environ
    host_list, hostfile, cluster = options.host_list, options.hostfile, options.cluster
    given = [flag for flag, v in (("-H", host_list), ("--hostfile", hostfile), ("--cluster", cluster)) if v is not None]
    for flag, v in (("-H", host_list), ("--hostfile", hostfile), ("--cluster", cluster)):
        if v is not None and not str(v).strip():
            raise UsageError(f"{flag}: empty value (leave the option out to use Slurm or localhost)")
    if len(given) > 1:
        raise UsageError(f"give only one of -H, --hostfile and --cluster (got {' and '.join(given)})")
    ssh_config = None
    if host_list is not None:
        hosts, source = parse_host_list(host_list), "-H"
    elif hostfile is not None:
        hosts, source = read_hostfile(hostfile), str(hostfile)
    elif cluster is not None:
        cf = read_cluster_file(cluster)
        hosts, source, ssh_config = list(cf.hosts), str(cluster), cf.ssh_config
    else:
        slurm = slurm_hosts(environ)
        if slurm is not None:
            hosts, source = slurm, SLURM_SOURCE
        else:
            hosts, source = [HostSlots("localhost", os.cpu_count() or 1, source="default")], "localhost (default)"
    hosts, warnings = merge_duplicates(hosts)
    hosts = select_hosts(hosts, options.include, options.exclude)
    return HostSelection(tuple(hosts), source, tuple(warnings), ssh_config)


def resolve_np(np, selection: HostSelection, oversubscribe: bool) -> int:
    """-np (the text or number given) defaults to the total slots; more than that needs --oversubscribe."""
    total = selection.total_slots
    if np is None:
        return total
    if isinstance(np, str):
        np = count(np, "-np", MAX_RANKS)
    if np <= 0:
        raise UsageError(f"-np must be a positive integer, got {np}")
    if np > MAX_RANKS:
        raise UsageError(f"-np must be at most {MAX_RANKS}, got {np}")
    if np > total and not oversubscribe:
        cores = ""
        if all_local(selection.hosts):
            cores = f"; this host has {os.cpu_count()} cores"
        raise UsageError(
            f"-np {np} is more than the {total} slots of {selection.source}{cores}: "
            f"add slots to the hosts or pass --oversubscribe"
        )
    return np


__all__ = [
    "HostOptions", "HostSelection", "HostfileError", "all_local", "is_local", "merge_duplicates",
    "resolve_hosts", "resolve_np", "select_hosts",
]
