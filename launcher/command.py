"""Building the mpirun command line: ``build_groups(spec, flavor)`` is pure.

Each group of arguments carries the reason it is there, so ``--dry-run`` can
print the command with a comment per line.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dtrun.launcher import safe
from dtrun.launcher.flavors import Flavor
from dtrun.launcher.hostfile import HostSlots

DEFAULT_EXCLUDE = ("lo", "docker0")
# Open MPI's routed tree (PRRTE's and ORTE's routed/radix): mpirun starts this many daemons
# itself; past that many hosts, inner daemons ssh to their children.
TREE_SPAWN_HOSTS = 64
# Where a user changes the radix: PRRTE (Open MPI 5) and ORTE (Open MPI 4) read these.
RADIX_ENV = ("PRTE_MCA_routed_radix", "OMPI_MCA_routed_radix")
# Secret-looking names: these words anywhere in the name ...
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|PASSPHRASE|CREDENTIAL|PRIVATE|KEY|COOKIE|SESSION|SIGNATURE", re.I)
# ... or these as a whole part of it (DB_PASS, GITHUB_PAT, X_AUTH, OPENAI_API_BASE; not PATH or PASSAGE).
_SECRET_PARTS = {"PASS", "PAT", "PW", "AUTH", "API", "CERT", "PIN", "OTP", "DSN", "JWT", "BEARER", "CRED", "CREDS"}
_URL_CREDENTIALS = re.compile(r"(?P<pre>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*:)(?P<pw>[^/@\s]+)(?P<at>@)")
REDACTED = "<redacted>"


@dataclass(frozen=True, kw_only=True)
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
    job_dir: Optional[str] = None  # where ranks leave state for `dtrun stacks` (launcher/remote/rankstate.py)
    nccl_debug: Optional[str] = None
    nccl_socket_ifname: Optional[str] = None  # the preflight's choice for NCCL (reason: iface_reason)
    no_tree_spawn: bool = False
    ssh_config: Optional[str] = None
    ssh_wrapper: Optional[str] = None  # MPICH: executable that runs ssh -F CONFIG
    ssh_control_path: Optional[str] = None  # Open MPI: the run's ssh master connections (launcher/sshmux.py)
    ssh_files: tuple = ()  # sshconf.GeneratedFile: written by the launch, shown by --dry-run
    as_root: bool = False
    rank_wrapper: tuple[str, ...] = ()
    # interfaces the preflight saw: (host, ((name, address/prefix), ...)) per remote host
    host_ifaces: tuple = ()
    launcher_addr: Optional[str] = None  # this host's address on the shared subnet (Hydra's -localhost)
    master_addr: Optional[str] = None  # torch.distributed env:// rendezvous (launcher/rendezvous.py)
    master_port: Optional[int] = None
    pin_gpus: bool = False  # --pin-gpus: the rank wrapper sets CUDA_VISIBLE_DEVICES per local rank
    horovod_alias: Optional[str] = None  # --horovod: the folder put first on the ranks' PYTHONPATH
    inherited_pythonpath: Optional[str] = None  # --horovod: this shell's PYTHONPATH, kept after that folder


def tree_radix(environ) -> int:
    """The radix of Open MPI's daemon tree: routed_radix from the environment, else 64.

    A value that is not a whole number of at least 1 is ignored, as mpirun would refuse it.
    """
    for name in RADIX_ENV:
        value = (environ.get(name) or "").strip()
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return TREE_SPAWN_HOSTS


@dataclass(frozen=True)
class ArgGroup:
    args: tuple[str, ...]
    why: str


def parse_env_item(item: str) -> tuple[str, Optional[str]]:
    """``NAME`` or ``NAME=VALUE`` from -x, validated (``launcher.safe.env_item``)."""
    return safe.env_item(item)


def is_secret_name(name: str) -> bool:
    """True for names whose values should not be printed (HF_TOKEN, DB_PASS, GITHUB_PAT, ...)."""
    if _SECRET.search(name):
        return True
    parts = re.split(r"[^A-Za-z0-9]+|(?<=[a-z])(?=[A-Z])", name)
    return any(p.upper() in _SECRET_PARTS for p in parts)


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
    if spec.master_addr:
        out.append(("MASTER_ADDR", spec.master_addr, "rank 0's host, for torch.distributed's env:// rendezvous"))
        out.append(("MASTER_PORT", str(spec.master_port), "a port chosen free at launch, the same on every rank"))
    if spec.horovod_alias:
        out.append(_horovod_pythonpath(spec, user))
    if spec.pin_gpus:
        out.append(("DTRUN_GPU_PER_RANK", "1", "--pin-gpus: each rank sees one GPU (local rank modulo the GPUs)"))
    if spec.rank_wrapper:
        out.append(("DTRUN_MARKER_TOKEN", None, "the rank wrappers sign their start, exit and end-of-output lines "
                                                "with this job's random token, so a program's own lines are never "
                                                "taken for them"))
    if spec.log_dir:
        out.append(("DTRUN_LOG_DIR", spec.log_dir, "--log-dir: this run's own directory (DIR/latest points to it); each rank writes rank.N.log there"))
    if spec.job_dir:
        out.append(("DTRUN_JOB_DIR", spec.job_dir, "each rank leaves its pid, stacks and flight recorder there "
                                                   "for dtrun stacks and --hang-timeout"))
    for name, value in user.items():
        out = [e for e in out if e[0] != name]
        out.append((name, value, "-x from the command line"))
    return out


def _horovod_pythonpath(spec: LaunchSpec, user: dict) -> tuple[str, str, str]:
    """--horovod's PYTHONPATH: dtrun's alias folder, then the user's own PYTHONPATH (-x
    PYTHONPATH=VALUE, else this shell's), which it takes out of ``user`` so that it is not set twice."""
    why = ("--horovod: dtrun's alias package first, so that `import horovod.torch` (.tensorflow, .keras) "
           "loads dtrun.collectives.horovod, in this job only")
    theirs, source = user.pop("PYTHONPATH", None), "the value of -x PYTHONPATH"
    if theirs is None:  # not set with -x (or forwarded by name): this shell's
        theirs, source = spec.inherited_pythonpath, "this shell's PYTHONPATH"
    if not theirs:
        return "PYTHONPATH", spec.horovod_alias, why
    return "PYTHONPATH", f"{spec.horovod_alias}:{theirs}", f"{why}; {source} kept after it"


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


# Open MPI 5 builds with UCX (the PyPI wheel) try osc/ucx for every MPI window; beside pml
# ob1, on hosts without a UCX device, its query fails and prints "OSC UCX component priority
# set inside component query failed" at each window creation (bare mpirun too). Leaving it
# out lets osc/rdma (over the BTLs dtrun chooses) and osc/sm serve the windows. Open MPI 4.1
# (Debian's build has osc/ucx too) does not print it, so nothing is added there.
OSC_WHY = ("MPI windows through osc/rdma and osc/sm: beside pml ob1, osc/ucx prints 'OSC UCX component priority "
           "set inside component query failed' at every window")
_MCA_FLAGS = ("--mca", "-mca", "--omca", "-omca", "--gmca", "-gmca")
_ENV_MCA = "OMPI_MCA_"


def _user_mca_settings(spec: LaunchSpec):
    """Every MCA parameter the user sets, as (name, value), in the order of precedence that
    ``_user_mca`` reads: --mca, -x OMPI_MCA_NAME, the environment, --mpi-args."""
    for k, v in spec.mca:
        yield k, v
    for item in spec.env:
        name, value = parse_env_item(item)
        if name.startswith(_ENV_MCA):
            yield name[len(_ENV_MCA):], value if value is not None else "(forwarded)"
    for name in sorted(spec.env_names_set):
        if name.startswith(_ENV_MCA):
            yield name[len(_ENV_MCA):], "(from the environment)"
    args = list(spec.mpi_args)
    for i, a in enumerate(args[:-1]):
        if a in _MCA_FLAGS:
            yield args[i + 1], args[i + 2] if i + 2 < len(args) else ""


def _user_mca(spec: LaunchSpec, key: str) -> Optional[str]:
    """The user's own value for MCA parameter ``key`` (--mca, -x OMPI_MCA_KEY, the environment, --mpi-args)."""
    return next((v for k, v in _user_mca_settings(spec) if k == key), None)


def osc_setting(spec: LaunchSpec, flavor: Flavor) -> Optional[tuple[str, str]]:
    """(value, why) for ``--mca osc`` where Open MPI needs it, or None: never over the user's own osc
    (or pml) choice, and only for Open MPI 5, where osc/ucx prints its error beside pml ob1."""
    if not flavor.is_openmpi or flavor.major < 5:
        return None
    if _user_mca(spec, "osc") is not None or _user_mca(spec, "pml") not in (None, "ob1"):
        return None
    return "^ucx", OSC_WHY


# Open MPI's allreduce between hosts: coll/tuned's dynamic rules (same format in 4.1 and 5),
# shipped beside the rank wrapper, which every host already needs at the same path.
COLL_RULES = str(Path(__file__).parent / "remote" / "ompi_coll_rules.conf")
COLL_WHY = ("allreduce of 1 MiB or more on 3 ranks or more as a ring: Open MPI's own choice sent 3.7x "
            "the bytes' time on a 3-host link, the ring 1.3x; smaller ones keep Open MPI's choice")
_COLL_PREFIX = "coll_tuned_"


def _users_coll_tuned(spec: LaunchSpec) -> bool:
    """Whether the user sets any coll/tuned parameter: dtrun's rules would turn on, or
    outrank, a forced algorithm of theirs."""
    return any(k.startswith(_COLL_PREFIX) for k, _ in _user_mca_settings(spec))


def coll_settings(spec: LaunchSpec, flavor: Flavor) -> list[tuple[str, str, str]]:
    """(MCA name, value, why) for the allreduce rules across hosts: Open MPI only, never on
    one machine (shared memory), and never over a coll/tuned setting of the user's."""
    if not flavor.is_openmpi or spec.local_only:
        return []
    if _users_coll_tuned(spec):
        return []
    if not safe.is_mca_word(COLL_RULES):
        return []  # an install path Open MPI could split: its own choice stays
    return [("coll_tuned_use_dynamic_rules", "1", COLL_WHY),
            ("coll_tuned_dynamic_rules_filename", COLL_RULES, "the rules file, in dtrun's install on every host")]


def _mca_group(picked: list[tuple[str, str, str]], why: str) -> list[ArgGroup]:
    """(name, value, why) settings as one group of --mca pairs, or none."""
    if not picked:
        return []
    return [ArgGroup(tuple(a for name, value, _ in picked for a in ("--mca", name, value)), why)]


def coll_groups(spec: LaunchSpec, flavor: Flavor) -> list[ArgGroup]:
    picked = coll_settings(spec, flavor)
    return _mca_group(picked, picked[0][2] if picked else "")


def transports(spec: LaunchSpec, flavor: Flavor) -> list[tuple[str, str, str]]:
    """(MCA name, value, why) for the pml and btl dtrun picks, leaving out any the user sets:
    Open MPI refuses a parameter given twice on one command line."""
    if flavor.major >= 5:
        want = [("pml", "ob1", "plain TCP between hosts, shared memory within one (no UCX/verbs probing)"),
                ("btl", "self,sm,tcp", "with the self, shared-memory and TCP transports")]
    else:
        # Named rather than "^openib": Debian's 4.1 also has btl/ofi, and osc/rdma then takes
        # its atomics, which abort every MPI window ("fi_fetch_atomic failed").
        want = [("pml", "ob1", "ob1 with the TCP and shared-memory BTLs (no UCX/verbs probing)"),
                ("btl", "self,vader,tcp", "self, shared memory and TCP only: openib is slow to probe, and "
                                          "btl/ofi breaks MPI windows (RMA)")]
    return [w for w in want if _user_mca(spec, w[0]) is None]


def transport_groups(spec: LaunchSpec, flavor: Flavor) -> list[ArgGroup]:
    picked = transports(spec, flavor)
    return _mca_group(picked, "; ".join(why for _, _, why in picked))


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
    g.extend(transport_groups(spec, flavor))
    g.extend(coll_groups(spec, flavor))
    osc = osc_setting(spec, flavor)
    if osc:
        g.append(ArgGroup(("--mca", "osc", osc[0]), osc[1]))
    g.extend(iface_groups_openmpi(spec, flavor))
    ssh_args, why = [], []
    if spec.ssh_config:
        # Open MPI splits this value on spaces without quoting: the path must be one plain word.
        ssh_args.append(f"-F {safe.mca_word(spec.ssh_config, 'ssh config path')}")
        why.append("ssh user/port/identity per host")
    if spec.ssh_control_path and not user_sets_ssh(spec):
        ssh_args.append(f"-o ControlMaster=no -o ControlPath={safe.mca_word(spec.ssh_control_path, 'ssh control path')}")
        why.append("the daemons' ssh sessions go through the run's open connection to each host")
    if ssh_args:
        key = ("--prtemca", "plm_ssh_args") if v5 else ("--mca", "plm_rsh_args")
        g.append(ArgGroup(key + (" ".join(ssh_args),), "; ".join(why)))
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


def user_sets_ssh(spec: LaunchSpec) -> bool:
    """Whether the user set how Open MPI starts its daemons (a ``plm_`` parameter through
    --mca, --mpi-args or the environment): dtrun's own ``plm_ssh_args`` would replace theirs,
    so a restart's mpirun then connects by itself (launcher/sshmux.py)."""
    return (any(key.startswith("plm_") for key, _ in spec.mca) or any("plm_" in a for a in spec.mpi_args)
            or any(n.startswith(("OMPI_MCA_plm_", "PRTE_MCA_plm_")) for n in spec.env_names_set))


def names_on_subnet(cidr: str, host_ifaces) -> dict[str, list[str]]:
    """Interface name(s) carrying ``cidr`` on each host, from the preflight's interface lists."""
    import ipaddress

    try:
        net = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return {}
    out = {}
    for host, ifaces in host_ifaces:
        names = []
        for name, addr in ifaces:
            try:
                if ipaddress.ip_interface(addr).ip in net and name not in names:
                    names.append(name)
            except ValueError:
                continue
        out[host] = names
    return out


def hydra_iface(spec: LaunchSpec) -> tuple[Optional[str], list[str]]:
    """Hydra's ``-iface NAME`` for the interface choice, and notes for what Hydra cannot take.

    Hydra takes one interface name for every host: a subnet maps to it when the preflight
    saw the same name carrying that subnet on every host.
    """
    if spec.local_only or not spec.include_iface:
        return None, []
    names = [i for i in spec.include_iface if "/" not in i]
    cidrs = [i for i in spec.include_iface if "/" in i]
    notes = []
    if len(names) > 1:
        notes.append(f"--include-iface {','.join(names)}: Hydra takes one interface name (-iface); using {names[0]}")
    if names:
        return names[0], notes
    cidr = cidrs[0]
    per_host = names_on_subnet(cidr, spec.host_ifaces)
    if not per_host:
        return None, [f"{cidr} ({spec.iface_reason}): Hydra takes an interface name, not a subnet, and the "
                      "interface names on the hosts are not known (the preflight reads them unless skipped); "
                      "--include-iface NAME sets one"]
    def plain(name):  # the names come from the hosts' own `ip addr`: only plain interface names pass
        try:
            return safe.iface(name, "interface") == name and "/" not in name
        except safe.InvalidValue:
            return False

    per_host = {h: [n for n in v if plain(n)] for h, v in per_host.items()}
    found = {n for v in per_host.values() for n in v}
    missing = [h for h, v in per_host.items() if not v]
    if len(found) == 1 and not missing:
        return found.pop(), []
    detail = "; ".join(f"{h}: {','.join(v) or 'none'}" for h, v in per_host.items())
    return None, [f"{cidr}: interface names on that subnet differ between hosts ({detail}); Hydra takes one "
                  "name for all, so no -iface is passed (rename the interfaces, or use Open MPI)"]


def flavor_notes(spec: LaunchSpec, flavor: Flavor) -> list[str]:
    """One line per option this flavor cannot honour as asked: shown in the dry run, warned at launch."""
    if flavor.is_openmpi:
        return []
    notes = []
    if spec.no_tree_spawn:
        notes.append("--no-tree-spawn: Hydra starts every proxy from this host already; nothing to add")
    user_exclude = [i for i in spec.exclude_iface if i not in DEFAULT_EXCLUDE]
    if user_exclude and not spec.include_iface and not spec.local_only:
        notes.append(f"--exclude-iface {','.join(user_exclude)}: Hydra has no exclude list, so it is not "
                     "passed; choose the network with --include-iface NAME (Hydra's -iface)")
    notes += hydra_iface(spec)[1]
    if not spec.include_iface and not spec.local_only and not user_exclude:
        notes.append("no -iface for Hydra: no subnet shared by every host was found (the preflight finds it "
                     "unless skipped), so Hydra picks the interface itself (--include-iface NAME sets it)")
    return notes


def _mpich_groups(spec: LaunchSpec, flavor: Flavor) -> list[ArgGroup]:
    g = [ArgGroup((flavor.mpirun, "-n", str(spec.np)), f"{spec.np} ranks; mpiexec by absolute path")]
    g.append(ArgGroup(("-hosts", _hosts_arg(spec.hosts)), f"hosts and slots from {spec.host_source}"))
    iface, _ = hydra_iface(spec)
    if iface and "-iface" not in spec.mpi_args:  # the user's own -iface (--mpi-args) wins; Hydra takes one
        g.append(ArgGroup(("-iface", iface), f"MPI traffic on {iface} ({spec.iface_reason})"))
    if spec.launcher_addr and not spec.local_only and "-localhost" not in spec.mpi_args:
        g.append(ArgGroup(("-localhost", spec.launcher_addr),
                          "proxies connect back to this address on the shared subnet (this host's own name may "
                          "resolve to a loopback address elsewhere)"))
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
    """Hide secret-looking values: ``NAME=V`` and ``--name=V`` (also after -x), ``-genv/-env NAME V``,
    and the password in ``scheme://user:password@host``."""
    out = list(args)
    for i, a in enumerate(args):
        prev = args[i - 1] if i else ""
        name, eq, _ = a.partition("=")
        if eq and is_secret_name(name.lstrip("-")) and (prev == "-x" or re.fullmatch(r"-{0,2}[A-Za-z_][\w.-]*", name)):
            out[i] = f"{name}={REDACTED}"
        elif i >= 2 and args[i - 2] in ("-genv", "-env", "--env") and is_secret_name(prev):
            out[i] = REDACTED
        elif prev.startswith("-") and "=" not in prev and is_secret_name(prev.lstrip("-")):
            out[i] = REDACTED  # --password VALUE
        else:
            out[i] = _URL_CREDENTIALS.sub(lambda m: m["pre"] + REDACTED + m["at"], a)
    return out


def format_dry_run(groups: list[ArgGroup], header: str = "", notes=()) -> str:
    """Shell-quoted command, one group per line with its reason, pasteable into bash."""
    rendered = [shlex.join(redact_args(grp.args)) for grp in groups]
    width = min(max(len(r) for r in rendered), 72)
    lines = [f"# {header}"] if header else []
    lines += [f"# note: {n}" for n in notes]
    lines.append("mpirun_cmd=(")
    for r, grp in zip(rendered, groups):
        lines.append(f"  {r.ljust(width)}  # {grp.why}")
    lines.append(")")
    lines.append('"${mpirun_cmd[@]}"')
    return "\n".join(lines)
