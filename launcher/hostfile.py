"""Parsing of host lists: -H strings, Open MPI / MPICH hostfiles, YAML cluster files, Slurm.

Pure functions from text to ``HostSlots``; reading files is done by the
``read_*`` helpers at the bottom so the parsers can be tested on strings.
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from launcher.errors import HostfileError

_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


@dataclass(frozen=True)
class HostSlots:
    """One host of a job and how many ranks it takes, plus SSH settings from a cluster file."""

    host: str
    slots: int = 1
    max_slots: Optional[int] = None
    user: Optional[str] = None
    port: Optional[int] = None
    identity_file: Optional[str] = None
    source: str = ""  # "file:line" or "-H", for messages

    @property
    def has_ssh_settings(self) -> bool:
        return bool(self.user or self.port or self.identity_file)


def validate_hostname(name: str, source: str, line: int | None = None) -> str:
    """Return ``name`` if it is a valid host name or IP address, else raise HostfileError.

    Host names end up on the command lines of ssh and mpirun; rejecting anything
    that is not a plain name keeps option-like or shell-special strings out.
    """
    if not name:
        raise HostfileError(source, line, "empty host name")
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise HostfileError(
            source, line,
            f"invalid host name {name!r} (letters, digits, '-', '_' and '.' only; no leading '-')",
        )
    return name


def _parse_slots(value: str, source: str, line: int | None, what: str = "slots") -> int:
    try:
        n = int(value, 10)
    except (TypeError, ValueError):
        raise HostfileError(source, line, f"{what} must be a positive integer, got {value!r}") from None
    if n <= 0:
        raise HostfileError(source, line, f"{what} must be a positive integer, got {n}")
    return n


def _split_host_colon(item: str, source: str, line: int | None) -> tuple[str, Optional[str]]:
    """Split ``host:N`` (and ``[v6addr]:N``) into the host and the slot text."""
    if item.startswith("["):
        end = item.find("]")
        if end < 0:
            raise HostfileError(source, line, f"unclosed '[' in {item!r}")
        host, rest = item[1:end], item[end + 1:]
        if rest and not rest.startswith(":"):
            raise HostfileError(source, line, f"unexpected {rest!r} after ']' in {item!r}")
        return host, (rest[1:] if rest else None)
    if item.count(":") > 1:  # a bare IPv6 address takes one slot
        return item, None
    host, sep, slots = item.partition(":")
    return host, (slots if sep else None)


def parse_host_list(text: str, source: str = "-H") -> list[HostSlots]:
    """Parse ``server1:4,server2:4,server3`` (a bare host means 1 slot)."""
    if not text or not text.strip():
        raise HostfileError(source, None, "empty host list")
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise HostfileError(source, None, f"empty entry in host list {text!r}")
        host, slots = _split_host_colon(item, source, None)
        validate_hostname(host, source)
        n = 1 if slots is None else _parse_slots(slots, source, None, f"slots for {host}")
        hosts.append(HostSlots(host, n, source=source))
    return hosts


def parse_hostfile(text: str, source: str) -> list[HostSlots]:
    """Parse an Open MPI (``host slots=N max_slots=M``) or MPICH (``host:N``) hostfile.

    Comments start with ``#``; blank lines are skipped. Both forms may be mixed.
    """
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        where = f"{source}:{lineno}"
        host, colon_slots = _split_host_colon(fields[0], source, lineno)
        validate_hostname(host, source, lineno)
        slots = _parse_slots(colon_slots, source, lineno) if colon_slots is not None else None
        max_slots = None
        for field in fields[1:]:
            key, eq, value = field.partition("=")
            if not eq:
                raise HostfileError(source, lineno, f"expected key=value after the host name, got {field!r}")
            key = key.strip().lower()
            if key in ("slots", "cpu", "cpus", "count"):
                if slots is not None:
                    raise HostfileError(source, lineno, "slots given twice")
                slots = _parse_slots(value, source, lineno)
            elif key == "max_slots":
                max_slots = _parse_slots(value, source, lineno, "max_slots")
            else:
                raise HostfileError(source, lineno, f"unknown key {key!r} (expected slots= or max_slots=)")
        if slots is None:
            slots = 1
        if max_slots is not None and max_slots < slots:
            raise HostfileError(source, lineno, f"max_slots={max_slots} is less than slots={slots}")
        hosts.append(HostSlots(host, slots, max_slots, source=where))
    if not hosts:
        raise HostfileError(source, None, "no hosts in file")
    return hosts


@dataclass(frozen=True)
class ClusterFile:
    """What a YAML cluster file holds beyond the hosts."""

    hosts: tuple[HostSlots, ...]
    ssh_config: Optional[str] = None


_HOST_KEYS = {"name", "host", "slots", "max_slots", "user", "port", "identity_file"}


def parse_cluster_yaml(text: str, source: str) -> ClusterFile:
    """Parse a YAML cluster file.

    Format::

        defaults: {slots: 4, user: mpi, port: 22, identity_file: ~/.ssh/id_ed25519}
        ssh_config: ~/.ssh/cluster_config     # optional
        hosts:
          - node1                             # a bare name takes the defaults
          - {name: node2, slots: 2, port: 2222}

    Errors name the line of the offending YAML node.
    """
    import yaml  # lazily: only cluster files need it

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise HostfileError(source, line, f"invalid YAML: {problem}") from None
    if root is None:
        raise HostfileError(source, None, "empty cluster file")
    if not isinstance(root, yaml.MappingNode):
        raise HostfileError(source, root.start_mark.line + 1, "expected a mapping with a 'hosts:' list")

    def line_of(node) -> int:
        return node.start_mark.line + 1

    def scalar(node, what: str) -> str:
        if not isinstance(node, yaml.ScalarNode):
            raise HostfileError(source, line_of(node), f"{what} must be a single value")
        return str(node.value)

    def host_options(mapping, where_line: int) -> dict:
        opts = {}
        for knode, vnode in mapping.value:
            key = scalar(knode, "a key")
            if key not in _HOST_KEYS:
                raise HostfileError(source, line_of(knode), f"unknown key {key!r} (expected one of {', '.join(sorted(_HOST_KEYS))})")
            value = scalar(vnode, key)
            ln = line_of(vnode)
            if key in ("slots", "max_slots"):
                opts[key] = _parse_slots(value, source, ln, key)
            elif key == "port":
                port = _parse_slots(value, source, ln, "port")
                if port > 65535:
                    raise HostfileError(source, ln, f"port must be 1-65535, got {port}")
                opts[key] = port
            elif key in ("name", "host"):
                opts["name"] = (validate_hostname(value, source, ln), ln)
            elif key == "user":
                if not re.match(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$", value):
                    raise HostfileError(source, ln, f"invalid user name {value!r}")
                opts[key] = value
            else:
                opts[key] = os.path.expanduser(value)
        return opts

    defaults: dict = {}
    ssh_config = None
    hosts_node = None
    for knode, vnode in root.value:
        key = scalar(knode, "a key")
        if key == "defaults":
            if not isinstance(vnode, yaml.MappingNode):
                raise HostfileError(source, line_of(vnode), "defaults must be a mapping")
            defaults = host_options(vnode, line_of(vnode))
            if "name" in defaults:
                raise HostfileError(source, line_of(vnode), "defaults cannot set a host name")
        elif key == "ssh_config":
            ssh_config = os.path.expanduser(scalar(vnode, "ssh_config"))
        elif key == "hosts":
            hosts_node = vnode
        else:
            raise HostfileError(source, line_of(knode), f"unknown key {key!r} (expected hosts, defaults, ssh_config)")
    if hosts_node is None:
        raise HostfileError(source, None, "no 'hosts:' list")
    if not isinstance(hosts_node, yaml.SequenceNode) or not hosts_node.value:
        raise HostfileError(source, line_of(hosts_node), "'hosts:' must be a non-empty list")

    hosts = []
    for item in hosts_node.value:
        ln = line_of(item)
        if isinstance(item, yaml.ScalarNode):
            opts = dict(defaults, name=(validate_hostname(item.value, source, ln), ln))
        elif isinstance(item, yaml.MappingNode):
            opts = dict(defaults, **host_options(item, ln))
            if "name" not in opts:
                raise HostfileError(source, ln, "host entry has no 'name:'")
        else:
            raise HostfileError(source, ln, "each host must be a name or a mapping with 'name:'")
        name, _ = opts.pop("name")
        slots = opts.pop("slots", 1)
        max_slots = opts.get("max_slots")
        if max_slots is not None and max_slots < slots:
            raise HostfileError(source, ln, f"max_slots={max_slots} is less than slots={slots}")
        hosts.append(HostSlots(name, slots, source=f"{source}:{ln}", **opts))
    return ClusterFile(tuple(hosts), ssh_config)


def slurm_hosts(environ: Mapping[str, str]) -> Optional[list[HostSlots]]:
    """Hosts and slots of the current Slurm allocation, or None outside one.

    Uses python-hostlist for the compressed ``node[01-04,07]`` and ``4(x2),2`` forms.
    A SLURM_JOB_NODELIST without SLURM_JOB_ID is a leftover of a shell that once ran
    in an allocation, not an allocation.
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or not (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")):
        return None
    import hostlist  # lazily: only inside Slurm

    source = "SLURM_JOB_NODELIST"
    try:
        names = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as exc:
        raise HostfileError(source, None, f"cannot expand {nodelist!r}: {exc}") from None
    tasks = environ.get("SLURM_TASKS_PER_NODE")
    if tasks:
        try:
            counts = hostlist.parse_slurm_tasks_per_node(tasks)
        except (hostlist.BadHostlist, ValueError) as exc:
            raise HostfileError("SLURM_TASKS_PER_NODE", None, f"cannot parse {tasks!r}: {exc}") from None
        if len(counts) != len(names):
            raise HostfileError(
                "SLURM_TASKS_PER_NODE", None,
                f"{tasks!r} gives {len(counts)} counts for {len(names)} nodes in {nodelist!r}",
            )
    else:
        counts = [1] * len(names)
    return [HostSlots(validate_hostname(n, source), c, source=source) for n, c in zip(names, counts) if c > 0]


def _read(path: str | os.PathLike) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise HostfileError(str(path), None, "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError(str(path), None, f"cannot read: {exc}") from None


def read_hostfile(path: str | os.PathLike) -> list[HostSlots]:
    return parse_hostfile(_read(path), str(path))


def read_cluster_file(path: str | os.PathLike) -> ClusterFile:
    return parse_cluster_yaml(_read(path), str(path))
