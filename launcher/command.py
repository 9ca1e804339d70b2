"""Building the mpirun command line: ``build_groups(spec, flavor)`` is pure.

Each group of arguments carries the reason it is there, so ``--dry-run`` can
print the command with a comment per line.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Optional

from launcher.errors import UsageError
from launcher.flavors import Flavor
from launcher.hostfile import HostSlots

DEFAULT_EXCLUDE = ("lo", "docker0")
# Open MPI's routed tree: from this many daemons on, inner daemons ssh to their children.
TREE_SPAWN_HOSTS = 64
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.I)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
REDACTED = "<redacted>"


@dataclass(frozen=True)
class LaunchSpec:
    """Everything that decides the mpirun command line, already validated."""

    program: tuple[str, ...]
    hosts: tuple[HostSlots, ...]
    np: int
    host_source: str = "-H"
    oversubscribe: bool = False
    include_iface: tuple[str, ...] = ()  # interface names or CIDRs to use
    exclude_iface: tuple[str, ...] = DEFAULT_EXCLUDE
    iface_reason: str = "default"  # "user", "shared subnet ...", "default", "local"
    local_only: bool = False  # every host is this machine: no network to choose
    env: tuple[str, ...] = ()  # user -x: NAME or NAME=VALUE
    env_names_set: frozenset = frozenset()  # names present in dtrun's environment
    mca: tuple[tuple[str, str], ...] = ()
    mpi_args: tuple[str, ...] = ()
    tag_output: bool = False
    log_dir: Optional[str] = None
    nccl_debug: Optional[str] = None
    nccl_socket_ifname: Optional[str] = None  # the preflight's choice for NCCL (reason: iface_reason)
    no_tree_spawn: bool = False
    ssh_config: Optional[str] = None
    ssh_wrapper: Optional[str] = None  # MPICH: executable that runs ssh -F CONFIG
    as_root: bool = False
    rank_wrapper: tuple[str, ...] = ()


@dataclass(frozen=True)
class ArgGroup:
    args: tuple[str, ...]
    why: str


def parse_env_item(item: str) -> tuple[str, Optional[str]]:
    """``NAME`` or ``NAME=VALUE`` from -x, validated."""
    name, eq, value = item.partition("=")
    if not _ENV_NAME.match(name):
        raise UsageError(f"-x {item!r}: {name!r} is not a valid environment variable name")
    return name, (value if eq else None)


def is_secret_name(name: str) -> bool:
    return bool(_SECRET.search(name))


def _hosts_arg(hosts, sep=":") -> str:
    return ",".join(f"[{h.host}]{sep}{h.slots}" if ":" in h.host else f"{h.host}{sep}{h.slots}" for h in hosts)


def _env_list(spec: LaunchSpec) -> list[tuple[str, Optional[str], str]]:
    """(name, value or None to forward, why) for every variable the job gets."""
    out = [("PATH", None, "ranks and remote daemons see the launching shell's PATH")]
    if "LD_LIBRARY_PATH" in spec.env_names_set:
        out.append(("LD_LIBRARY_PATH", None, "and its LD_LIBRARY_PATH (non-interactive remote shells often lack it)"))
    user = dict(parse_env_item(e) for e in spec.env)
    if not spec.local_only and "NCCL_SOCKET_IFNAME" not in user and "NCCL_SOCKET_IFNAME" not in spec.env_names_set:
        names = [i for i in spec.include_iface if "/" not in i]
        if spec.nccl_socket_ifname:
            out.append(("NCCL_SOCKET_IFNAME", spec.nccl_socket_ifname, f"NCCL on the same network ({spec.iface_reason})"))
        elif names:
            out.append(("NCCL_SOCKET_IFNAME", ",".join(names), f"NCCL uses the chosen interface ({spec.iface_reason})"))
        else:
            excl = ",".join(spec.exclude_iface or DEFAULT_EXCLUDE)
            out.append(("NCCL_SOCKET_IFNAME", f"^{excl}",
                        f"NCCL skips {excl} ('^' excludes every name in the list, so lo stays in it; "
                        "'^docker0' alone would let NCCL pick lo)"))
    if spec.nccl_debug:
        out.append(("NCCL_DEBUG", spec.nccl_debug, "--nccl-debug"))
    if spec.log_dir:
        out.append(("DTRUN_LOG_DIR", spec.log_dir, "--log-dir: this run's own directory (DIR/latest points to it); each rank writes rank.N.log there"))
    for name, value in user.items():
        out = [e for e in out if e[0] != name]
        out.append((name, value, "-x from the command line"))
    return out


def iface_groups_openmpi(spec: LaunchSpec, flavor: Flavor) -> list[ArgGroup]:
    if spec.local_only:
        return []
    v5 = flavor.major >= 5
    groups = []
    if spec.include_iface:
        val = ",".join(spec.include_iface)
        why = f"MPI traffic on {val} ({spec.iface_reason})"
        groups.append(ArgGroup(("--mca", "btl_tcp_if_include", val), why))
        if v5:
            groups.append(ArgGroup(("--prtemca", "prte_if_include", val),
                                   "the runtime's own wiring (PRRTE daemons) on the same network"))
            groups.append(ArgGroup(("--pmixmca", "ptl_base_if_include", val),
                                   "PMIx connections on the same network"))
        else:
            groups.append(ArgGroup(("--mca", "oob_tcp_if_include", val),
                                   "the runtime's own wiring (ORTE daemons) on the same network"))
    else:
        val = ",".join(spec.exclude_iface)
        why = f"keep MPI traffic off {val}: docker0 carries the same address on every host and hangs the job"
        if spec.iface_reason != "default":
            why += f" ({spec.iface_reason})"
        groups.append(ArgGroup(("--mca", "btl_tcp_if_exclude", val), why))
        if not v5:
            groups.append(ArgGroup(("--mca", "oob_tcp_if_exclude", val), "the runtime's own wiring avoids them too"))
        # Open MPI 5: PRRTE's exclude list was seen to crash mpirun intermittently (segfaults in
        # 4 of 6 runs across three hosts with docker0), so the runtime is only restricted by include.
    return groups


def build_groups(spec: LaunchSpec, flavor: Flavor) -> list[ArgGroup]:
    """The mpirun command for ``spec`` as groups of arguments, each with its reason."""
    if flavor.is_openmpi:
        return _openmpi_groups(spec, flavor)
    return _mpich_groups(spec, flavor)


def _openmpi_groups(spec: LaunchSpec, flavor: Flavor) -> list[ArgGroup]:
    v5 = flavor.major >= 5
    g = [ArgGroup((flavor.mpirun, "-np", str(spec.np)), f"{spec.np} ranks; mpirun by absolute path")]
    g.append(ArgGroup(("-H", _hosts_arg(spec.hosts)), f"hosts and slots from {spec.host_source}"))
    if flavor.prefix and not spec.local_only:
        g.append(ArgGroup(("--prefix", flavor.prefix),
                          "remote daemons find Open MPI's bin/ and lib/ even if the non-interactive PATH lacks them"))
    if spec.as_root:
        g.append(ArgGroup(("--allow-run-as-root",), "running as root"))
    g.append(ArgGroup(("--bind-to", "none"), "no core pinning: data loaders and NCCL threads need more than one core"))
    if v5:
        mapping = "slot:oversubscribe" if spec.oversubscribe else "slot"
        why = "fill each host's slots in order" + (" (oversubscribe: more ranks than slots allowed)" if spec.oversubscribe else "")
        g.append(ArgGroup(("--map-by", mapping), why))
    else:
        g.append(ArgGroup(("--map-by", "slot"), "fill each host's slots in order"))
        if spec.oversubscribe:
            g.append(ArgGroup(("--oversubscribe",), "more ranks than slots allowed"))
    if v5:
        g.append(ArgGroup(("--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp"),
                          "plain TCP between hosts, shared memory within one (no UCX/verbs probing)"))
    else:
        g.append(ArgGroup(("--mca", "pml", "ob1", "--mca", "btl", "^openib"),
                          "ob1 with the TCP and shared-memory BTLs; openib is deprecated and slow to probe"))
    g.extend(iface_groups_openmpi(spec, flavor))
    if spec.ssh_config:
        key = ("--prtemca", "plm_ssh_args") if v5 else ("--mca", "plm_rsh_args")
        g.append(ArgGroup(key + (f"-F {spec.ssh_config}",), "ssh user/port/identity per host"))
    if spec.no_tree_spawn:
        key = ("--prtemca", "plm_ssh_no_tree_spawn", "1") if v5 else ("--mca", "plm_rsh_no_tree_spawn", "1")
        g.append(ArgGroup(key, "start every daemon from this host: no host needs ssh to another"))
    if spec.tag_output:
        g.append(ArgGroup(("--output", "tag") if v5 else ("--tag-output",), "prefix each output line with its rank"))
    for name, value, why in _env_list(spec):
        g.append(ArgGroup(("-x", name if value is None else f"{name}={value}"), why))
    for key, value in spec.mca:
        g.append(ArgGroup(("--mca", key, value), "--mca from the command line"))
    if spec.mpi_args:
        g.append(ArgGroup(tuple(spec.mpi_args), "--mpi-args, passed unchanged"))
    g.append(_program_group(spec))
    return g


def _mpich_groups(spec: LaunchSpec, flavor: Flavor) -> list[ArgGroup]:
    if spec.mca:
        raise UsageError("--mca is an Open MPI option; this mpirun is MPICH (Hydra)")
    g = [ArgGroup((flavor.mpirun, "-n", str(spec.np)), f"{spec.np} ranks; mpiexec by absolute path")]
    g.append(ArgGroup(("-hosts", _hosts_arg(spec.hosts)), f"hosts and slots from {spec.host_source}"))
    names = [i for i in spec.include_iface if "/" not in i]
    if names and not spec.local_only:
        g.append(ArgGroup(("-iface", names[0]), f"MPI traffic on {names[0]} ({spec.iface_reason})"))
    if spec.ssh_wrapper:
        g.append(ArgGroup(("-launcher-exec", spec.ssh_wrapper), f"ssh with per-host settings from {spec.ssh_config}"))
    if spec.tag_output:
        g.append(ArgGroup(("-prepend-rank",), "prefix each output line with its rank"))
    forward, values = [], []
    for name, value, why in _env_list(spec):
        if value is None:
            forward.append(name)
        else:
            values.append((name, value, why))
    if forward:
        g.append(ArgGroup(("-genvlist", ",".join(forward)), "forward " + ", ".join(forward) + " to every rank"))
    for name, value, why in values:
        g.append(ArgGroup(("-genv", name, value), why))
    if spec.mpi_args:
        g.append(ArgGroup(tuple(spec.mpi_args), "--mpi-args, passed unchanged"))
    g.append(_program_group(spec))
    return g


def _program_group(spec: LaunchSpec) -> ArgGroup:
    why = "your program"
    if spec.rank_wrapper:
        why += ", under dtrun's rank wrapper (DTRUN_RANK & co.; an uncaught Python exception aborts the job)"
    return ArgGroup(tuple(spec.rank_wrapper) + tuple(spec.program), why)


def build_command(spec: LaunchSpec, flavor: Flavor) -> list[str]:
    return [a for grp in build_groups(spec, flavor) for a in grp.args]


def redact_args(args) -> list[str]:
    """Hide the values of secret-looking variables (-x NAME=V, -genv NAME V, env NAME=V)."""
    out = list(args)
    for i, a in enumerate(out):
        prev = out[i - 1] if i else ""
        # "env NAME=V" of the srun command, whose assignments may each be a group of their own
        if (prev == "-x" or prev == "env" or i == 0) and "=" in a:
            name, _, _ = a.partition("=")
            if is_secret_name(name):
                out[i] = f"{name}={REDACTED}"
        elif i >= 2 and out[i - 2] == "-genv" and is_secret_name(prev):
            out[i] = REDACTED
    return out


def format_dry_run(groups: list[ArgGroup], header: str = "") -> str:
    """Shell-quoted command, one group per line with its reason, pasteable into bash."""
    rendered = [shlex.join(redact_args(grp.args)) for grp in groups]
    width = min(max(len(r) for r in rendered), 72)
    lines = [f"# {header}"] if header else []
    lines.append("mpirun_cmd=(")
    for r, grp in zip(rendered, groups):
        lines.append(f"  {r.ljust(width)}  # {grp.why}")
    lines.append(")")
    lines.append('"${mpirun_cmd[@]}"')
    return "\n".join(lines)
