"""Parsing of host lists: -H strings, Open MPI / MPICH hostfiles, YAML cluster files, Slurm.

Pure functions from text to ``HostSlots``; reading files is done by the
``read_*`` helpers at the bottom so the parsers can be tested on strings.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from dtrun.launcher import safe
from dtrun.launcher.errors import HostfileError, InvalidValue

MAX_FILE_BYTES = 4 << 20  # a hostfile or cluster file larger than this is not one


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

    Host names end up on the command lines of ssh and mpirun and in generated ssh
    configs; ``launcher.safe.host_name`` admits plain names and addresses only.
    """
    try:
        return safe.host_name(name)
    except InvalidValue as exc:
        raise HostfileError(source, line, str(exc)) from None


def _parse_slots(value: str, source: str, line: int | None, what: str = "slots") -> int:
    try:
        return safe.count(value, what, safe.MAX_SLOTS)
    except InvalidValue as exc:
        raise HostfileError(source, line, str(exc)) from None


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

    reader = _ClusterReader(yaml, source)
    defaults, ssh_config, hosts_node = reader.top_level(reader.compose(text))
    return ClusterFile(tuple(reader.host(item, defaults) for item in hosts_node.value), ssh_config)


class _ClusterReader:
    """The YAML nodes of one cluster file, read into checked values; errors name the node's line."""

    def __init__(self, yaml, source: str):
        self.yaml = yaml
        self.source = source

    def error(self, line: Optional[int], message: str) -> HostfileError:
        return HostfileError(self.source, line, message)

    def compose(self, text: str):
        """The root mapping node of ``text``."""
        yaml = self.yaml
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except RecursionError:
            raise self.error(None, "invalid YAML: nested too deeply") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = mark.line + 1 if mark is not None else None
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise self.error(line, f"invalid YAML: {problem}") from None
        if root is None:
            raise self.error(None, "empty cluster file")
        if not isinstance(root, yaml.MappingNode):
            raise self.error(root.start_mark.line + 1, "expected a mapping with a 'hosts:' list")
        return root

    @staticmethod
    def line_of(node) -> int:
        return node.start_mark.line + 1

    def scalar(self, node, what: str) -> str:
        if not isinstance(node, self.yaml.ScalarNode):
            raise self.error(self.line_of(node), f"{what} must be a single value")
        return str(node.value)

    def keys_once(self, mapping):
        seen = set()
        for knode, vnode in mapping.value:
            key = self.scalar(knode, "a key")
            if key in seen:
                raise self.error(self.line_of(knode), f"key {key!r} given twice")
            seen.add(key)
            yield key, knode, vnode

    def path_value(self, value: str, ln: int, what: str) -> str:
        path = os.path.abspath(os.path.expanduser(value))
        self.checked(safe.ssh_config_path, path, what, line=ln)
        return path

    def checked(self, check, *args, line: int):
        """``check(*args)``, its InvalidValue turned into an error at ``line``."""
        try:
            return check(*args)
        except InvalidValue as exc:
            raise self.error(line, str(exc)) from None

    def top_level(self, root) -> tuple[dict, Optional[str], object]:
        """(defaults, ssh_config, the hosts sequence node) from the root mapping."""
        yaml, defaults, ssh_config, hosts_node = self.yaml, {}, None, None
        for key, knode, vnode in self.keys_once(root):
            if key == "defaults":
                if not isinstance(vnode, yaml.MappingNode):
                    raise self.error(self.line_of(vnode), "defaults must be a mapping")
                defaults = self.host_options(vnode)
                if "name" in defaults:
                    raise self.error(self.line_of(vnode), "defaults cannot set a host name")
            elif key == "ssh_config":
                ssh_config = self.path_value(self.scalar(vnode, "ssh_config"), self.line_of(vnode), "ssh_config")
            elif key == "hosts":
                hosts_node = vnode
            else:
                raise self.error(self.line_of(knode), f"unknown key {key!r} (expected hosts, defaults, ssh_config)")
        if hosts_node is None:
            raise self.error(None, "no 'hosts:' list")
        if not isinstance(hosts_node, yaml.SequenceNode) or not hosts_node.value:
            raise self.error(self.line_of(hosts_node), "'hosts:' must be a non-empty list")
        return defaults, ssh_config, hosts_node

    def host_options(self, mapping) -> dict:
        opts = {}
        for key, knode, vnode in self.keys_once(mapping):
            if key not in _HOST_KEYS:
                raise self.error(self.line_of(knode), f"unknown key {key!r} (expected one of {', '.join(sorted(_HOST_KEYS))})")
            value = self.scalar(vnode, key)
            ln = self.line_of(vnode)
            if key in ("slots", "max_slots"):
                opts[key] = _parse_slots(value, self.source, ln, key)
            elif key == "port":
                opts[key] = self.checked(safe.port, value, line=ln)
            elif key in ("name", "host"):
                opts["name"] = (validate_hostname(value, self.source, ln), ln)
            elif key == "user":
                opts[key] = self.checked(safe.user_name, value, line=ln)
            else:
                opts[key] = self.path_value(value, ln, key)
        return opts

    def host(self, item, defaults: dict) -> HostSlots:
        """One entry of ``hosts:``: a bare name, or a mapping over the defaults."""
        ln = self.line_of(item)
        if isinstance(item, self.yaml.ScalarNode):
            opts = dict(defaults, name=(validate_hostname(item.value, self.source, ln), ln))
        elif isinstance(item, self.yaml.MappingNode):
            opts = dict(defaults, **self.host_options(item))
            if "name" not in opts:
                raise self.error(ln, "host entry has no 'name:'")
        else:
            raise self.error(ln, "each host must be a name or a mapping with 'name:'")
        name, _ = opts.pop("name")
        slots = opts.pop("slots", 1)
        max_slots = opts.get("max_slots")
        if max_slots is not None and max_slots < slots:
            raise self.error(ln, f"max_slots={max_slots} is less than slots={slots}")
        return HostSlots(name, slots, source=f"{self.source}:{ln}", **opts)


def hostlist_size(nodelist: str) -> int:
    """How many names a Slurm node list like ``n[01-04,07],m[1-2]x[1-3]`` expands to, without expanding it.

    A best-effort count used to refuse lists too large to expand; malformed lists are
    left for python-hostlist to report.
    """
    total, depth, segment = 0, 0, []
    for c in nodelist + ",":
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        if c == "," and depth == 0:
            n = 1
            for ranges in re.findall(r"\[([^\]]*)\]", "".join(segment)):
                size = 0
                for part in ranges.split(","):
                    lo, _, hi = part.partition("-")
                    if lo.isascii() and lo.isdigit() and hi.isascii() and hi.isdigit():
                        size += max(0, int(hi) - int(lo)) + 1  # Python ints: no overflow however long
                    else:
                        size += 1
                n *= max(size, 1)
            total += n
            segment = []
        else:
            segment.append(c)
    return total


def slurm_hosts(environ: Mapping[str, str]) -> Optional[list[HostSlots]]:
    """Hosts and slots of the current Slurm allocation, or None outside one.

    Uses python-hostlist for the compressed ``node[01-04,07]`` and ``4(x2),2`` forms,
    after checking that neither expands beyond ``safe.MAX_HOSTS`` entries.
    A SLURM_JOB_NODELIST without SLURM_JOB_ID is a leftover of a shell that once ran
    in an allocation, not an allocation.
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or not (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")):
        return None
    import hostlist  # lazily: only inside Slurm

    source = "SLURM_JOB_NODELIST"
    if len(nodelist) > 65536 or hostlist_size(nodelist) > safe.MAX_HOSTS:
        raise HostfileError(source, None, f"{nodelist[:40]!r}{'...' if len(nodelist) > 40 else ''} names more than "
                                          f"{safe.MAX_HOSTS} nodes; dtrun launches at most {safe.MAX_HOSTS} hosts")
    try:
        names = hostlist.expand_hostlist(nodelist)
    except (hostlist.BadHostlist, ValueError, RecursionError) as exc:
        raise HostfileError(source, None, f"cannot expand {nodelist!r}: {exc}") from None
    tasks = environ.get("SLURM_TASKS_PER_NODE")
    if tasks:
        reps = sum(int(r) for r in re.findall(r"\(x(\d+)\)", tasks))
        if len(tasks) > 65536 or reps > safe.MAX_HOSTS:
            raise HostfileError("SLURM_TASKS_PER_NODE", None, f"{tasks[:40]!r} gives more than {safe.MAX_HOSTS} counts")
        try:
            counts = hostlist.parse_slurm_tasks_per_node(tasks)
        except (hostlist.BadHostlist, ValueError) as exc:
            raise HostfileError("SLURM_TASKS_PER_NODE", None, f"cannot parse {tasks!r}: {exc}") from None
        if len(counts) != len(names):
            raise HostfileError(
                "SLURM_TASKS_PER_NODE", None,
                f"{tasks!r} gives {len(counts)} counts for {len(names)} nodes in {nodelist!r}",
            )
        if not any(c > 0 for c in counts):
            raise HostfileError("SLURM_TASKS_PER_NODE", None,
                                f"{tasks!r} gives no tasks to any node of {nodelist!r}; the allocation has no slots "
                                f"(check the srun/sbatch --ntasks options)")
        big = [c for c in counts if c > safe.MAX_SLOTS]
        if big:
            raise HostfileError("SLURM_TASKS_PER_NODE", None,
                                f"{big[0]} tasks on one node is more than {safe.MAX_SLOTS}")
    else:
        counts = [1] * len(names)
    return [HostSlots(validate_hostname(n, source), c, source=source) for n, c in zip(names, counts) if c > 0]


def _read(path: str | os.PathLike) -> str:
    """The text of a hostfile or cluster file: a regular file, at most MAX_FILE_BYTES, UTF-8.

    Opened without blocking, so a FIFO is refused instead of waiting for a writer,
    and read with a bound, so /dev/zero is refused instead of filling memory.
    """
    where = str(path)
    if not where:
        raise HostfileError("''", None, "empty file name")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise HostfileError(where, None, "no such file") from None
    except OSError as exc:
        raise HostfileError(where, None, f"cannot read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket")
            raise HostfileError(where, None, f"is {kind}, not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise HostfileError(where, None, f"is {st.st_size} bytes; a host file is at most {MAX_FILE_BYTES}")
        data = os.read(fd, MAX_FILE_BYTES + 1)
        chunks = [data]
        while data and sum(map(len, chunks)) <= MAX_FILE_BYTES:
            data = os.read(fd, MAX_FILE_BYTES + 1)
            chunks.append(data)
        raw = b"".join(chunks)
        if len(raw) > MAX_FILE_BYTES:
            raise HostfileError(where, None, f"is larger than {MAX_FILE_BYTES} bytes")
    except OSError as exc:
        raise HostfileError(where, None, f"cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HostfileError(where, None, f"not UTF-8 text (byte {exc.start})") from None


def read_hostfile(path: str | os.PathLike) -> list[HostSlots]:
    return parse_hostfile(_read(path), str(path))


def read_cluster_file(path: str | os.PathLike) -> ClusterFile:
    return parse_cluster_yaml(_read(path), str(path))
