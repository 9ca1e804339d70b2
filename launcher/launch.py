"""The launch command's options and what they resolve to: options → hosts → MPI flavor → LaunchSpec → the command.

``LaunchOptions`` is what the user typed; ``prepare`` settles everything a launch (or
``--dry-run``) depends on, with ``make_spec`` as its pure core. Running the command is
not here: one attempt is ``launcher/attempt.py``, the run of attempts ``launcher/run.py``.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from dtrun.launcher import command as cmd
from dtrun.launcher import slurm
from dtrun.launcher.errors import LaunchError, UsageError
from dtrun.launcher.flavors import Flavor, detect_flavor, find_mpirun
from dtrun.launcher.hosts import SLURM_SOURCE, HostOptions, HostSelection, all_local, is_local, resolve_hosts
from dtrun.launcher.netinfo import (DRY_RUN_RESOLVE_S, RESOLVE_TIMEOUT_S, InterfaceChoice, SharedSubnet,
                                    infer_shared_subnet, local_address_on, local_addresses)
from dtrun.launcher.paths import new_run_id
from dtrun.launcher.rendezvous import choose
from dtrun.launcher.usage import Usage, check_usage, split_ifaces

RANKEXEC = str(Path(__file__).parent / "remote" / "rankexec.py")
# --horovod: the folder whose `horovod` package maps Horovod's modules to dtrun.collectives.horovod
# (collectives/horovod/_alias/horovod/_finder.py); a sibling of launcher/ both in the source tree
# and installed (dtrun/launcher, dtrun/collectives).
HOROVOD_ALIAS = str(Path(__file__).parent.parent / "collectives" / "horovod" / "_alias")
# Every rank's wrapper must have started by then (ssh, daemons and the wrapper's own start),
# or the hosts they were meant for are named and the job is stopped (0 turns it off).
DEFAULT_START_TIMEOUT_S = 120.0


def check_seconds(value: Optional[float], flag: str) -> Optional[float]:
    """A time limit from the command line: a finite number of seconds above 0 (0 means none)."""
    if value is None:
        return None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{flag} {value}: give a number of seconds above 0 (0 turns the limit off)")
    return value or None


# The preflight the CLI hands to the launch: (options, hosts, flavor, environ) -> interface choice or None.
Preflight = Callable[..., Optional[InterfaceChoice]]


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """What the user asked for on the command line, before anything is resolved."""

    program: tuple[str, ...]
    np: Optional[int | str] = None  # as typed: launcher.safe.count reads it (ASCII digits only)
    hosts: HostOptions = HostOptions()  # -H, --hostfile, --cluster, --include, --exclude, --ssh-config
    oversubscribe: bool = False
    include_iface: Optional[str] = None
    exclude_iface: Optional[str] = None
    env: tuple[str, ...] = ()
    mca: tuple[tuple[str, str], ...] = ()
    mpi_args: Optional[str] = None
    tag_output: Optional[bool] = None
    log_dir: Optional[str] = None
    nccl_debug: Optional[str] = None
    no_tree_spawn: bool = False
    mpirun: Optional[str] = None
    dry_run: bool = False
    rank_wrapper: bool = True
    pin_gpus: bool = False  # CUDA_VISIBLE_DEVICES per local rank, set by the rank wrapper
    horovod: bool = False  # `import horovod` loads dtrun.collectives.horovod on the ranks (PYTHONPATH)
    preflight: bool = True  # check ssh and choose interfaces before a multi-host launch (checks/preflight.py)
    verbose: bool = False  # print the decisions (the --dry-run text) on stderr before launching
    hang_timeout: Optional[float] = None  # report (or abort) after this many seconds without progress
    on_hang: str = "report"
    timeout: Optional[float] = None  # seconds the whole run may take, restarts included
    start_timeout: Optional[float] = DEFAULT_START_TIMEOUT_S  # seconds until every rank has started
    launcher: str = "auto"  # "srun", "mpirun", or srun inside an allocation when the MPI can (launcher/slurm.py)
    max_restarts: int = 0  # restart a failed job up to N times without the hosts that fail the check (launcher/restarts.py)
    min_np: Optional[int | str] = None  # a restarted job may go on with fewer ranks, down to this
    spares: Optional[str] = None  # hosts (-H syntax) a restarted job may use in place of lost ones
    host_discovery_script: Optional[str] = None  # prints the hosts the job may use now (launcher/elastic.py)
    max_np: Optional[int | str] = None  # with --host-discovery-script: the most ranks the job grows to
    top: bool = False  # --top: the live table of `dtrun top` on stderr while the job runs (launcher/straggler.py)


@dataclass(frozen=True)
class AttemptSetup:
    """What the run (launcher/run.py) settles for one attempt, beside the user's options."""

    job_dir: Optional[str] = None  # where ranks leave state for `dtrun stacks` (none: a dry run, no wrapper)
    selection: Optional[HostSelection] = None  # this attempt's hosts (None: those the options name)
    run_id: Optional[str] = None  # --log-dir: this attempt's subdirectory (None: time and pid)
    deadline: Optional[float] = None  # time.monotonic() when the run's --timeout ends (restarts share it)
    ssh_control_path: Optional[str] = None  # the run's ssh master connections, for mpirun's ssh (launcher/sshmux.py)


def warn(msg: str) -> None:
    print(f"dtrun: warning: {msg}", file=sys.stderr)


def resolve_program(program, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The program with its command name made absolute from this shell's PATH.

    Ranks must run the ``python`` the user's shell would run; Open MPI builds configured
    with --enable-mpirun-prefix-by-default (Debian's, for one) put their prefix's bin/
    first on the ranks' PATH, so a bare ``python3`` there became /usr/bin/python3 (seen on
    Open MPI 4.1.6) instead of the virtual environment's. Hosts share paths, as MPI assumes.
    """
    program = tuple(program)
    if program and os.sep not in program[0]:
        found = shutil.which(program[0], path=environ.get("PATH"))
        if found:
            return (os.path.abspath(found),) + program[1:]
    return program


def exclusions(user: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """--exclude-iface adds to dtrun's default (lo, docker0); it never replaces it.

    Open MPI's btl_tcp_if_exclude replaces Open MPI's own default (which holds lo), and
    NCCL's '^' list excludes only what it names: without lo, both may pick loopback.
    """
    merged = tuple(dict.fromkeys(cmd.DEFAULT_EXCLUDE + tuple(user)))
    added = [i for i in merged if i not in cmd.DEFAULT_EXCLUDE]
    return merged, f"{', '.join(added) or 'nothing new'} from --exclude-iface, added to dtrun's default {','.join(cmd.DEFAULT_EXCLUDE)}"


@dataclass(frozen=True)
class LocalFacts:
    """What ``make_spec`` needs from this machine's network, gathered by ``prepare`` (DNS, ``ip``)."""

    shared: Optional[SharedSubnet] = None  # the subnet that reaches every host, guessed on this machine
    addresses: tuple[tuple[str, str], ...] = ()  # (interface, IPv4 address) of this machine, up, not loopback


def wants_local_inference(opts: LaunchOptions, flavor: Flavor, selection: HostSelection,
                          choice: Optional[InterfaceChoice], environ: Mapping[str, str]) -> bool:
    """Whether the subnet must be guessed on this machine (DNS and local interfaces): several
    hosts and no subnet named by the user or the preflight. Open MPI then includes the guess;
    Hydra needs this host's address on it (-localhost)."""
    if all_local(selection.hosts):
        return False
    # The interfaces the user or the preflight named (as _interfaces takes them), from checked options.
    named = opts.include_iface or ("" if opts.exclude_iface or choice is None else choice.include or "")
    if flavor.is_openmpi:
        return not named and not opts.exclude_iface
    return "/" not in named


def _user_sets_nccl_ifname(usage: Usage, environ: Mapping[str, str]) -> bool:
    return "NCCL_SOCKET_IFNAME" in environ or any(name == "NCCL_SOCKET_IFNAME" for name, _ in usage.env)


def _interfaces(opts: LaunchOptions, usage: Usage, flavor: Flavor, environ: Mapping[str, str], local_only: bool,
                choice: Optional[InterfaceChoice], shared: Optional[SharedSubnet]):
    """(include, exclude, reason, NCCL_SOCKET_IFNAME) from the user's flags (checked: ``usage``), else
    the preflight's choice, else the subnet inferred on this machine, else dtrun's default exclusions."""
    nccl = None
    if choice is not None and choice.include and choice.nccl and not opts.exclude_iface \
            and not _user_sets_nccl_ifname(usage, environ) and (opts.include_iface or choice.include) == choice.include:
        nccl = choice.nccl
    if usage.include_iface:
        return usage.include_iface, cmd.DEFAULT_EXCLUDE, "--include-iface", nccl
    if usage.exclude_iface:
        exclude, reason = exclusions(usage.exclude_iface)
        return (), exclude, reason, None
    if choice is not None and choice.include:
        return split_ifaces(choice.include, "the preflight's subnet"), cmd.DEFAULT_EXCLUDE, choice.reason, nccl
    if shared is not None and not local_only and flavor.is_openmpi:
        return ((shared.cidr,), cmd.DEFAULT_EXCLUDE,
                f"the subnet of {shared.iface} routes to every host, inferred on this machine (no preflight)", None)
    return (), cmd.DEFAULT_EXCLUDE, "default", None


# The variables of dtrun's environment whose presence the command depends on (LaunchSpec.env_names_set).
_ENV_NAMES_NOTED = ("LD_LIBRARY_PATH", "NCCL_SOCKET_IFNAME", "OMPI_MCA_osc", "OMPI_MCA_pml", "OMPI_MCA_btl",
                    "SLURM_PMIX_FENCE")
# any coll/tuned setting of the user's keeps dtrun's rules off; any plm setting, dtrun's ssh connections
_ENV_PREFIXES_NOTED = ("OMPI_MCA_coll_tuned_", "OMPI_MCA_plm_", "PRTE_MCA_plm_")


def _launcher_address(flavor: Flavor, selection: HostSelection, include: tuple, local: LocalFacts) -> Optional[str]:
    """Hydra's -localhost: this host's address on the subnet named, else on the one guessed here."""
    if flavor.is_openmpi or all_local(selection.hosts):
        return None
    cidr = next((i for i in include if "/" in i), None) or (local.shared.cidr if local.shared else None)
    return local_address_on(cidr, local.addresses) if cidr else None


def make_spec(opts: LaunchOptions, flavor: Flavor, selection: HostSelection, environ: Mapping[str, str],
              choice: Optional[InterfaceChoice] = None, local: LocalFacts = LocalFacts(),
              setup: AttemptSetup = AttemptSetup(), usage: Optional[Usage] = None) -> cmd.LaunchSpec:
    """Settle every choice the command line depends on. Pure: no DNS, no ``ip``, no file written.

    Args:
        choice: the preflight's interface choice, applied unless the user chose interfaces.
        local: this machine's network (``prepare`` gathers it): the subnet guessed here,
            used when nobody chose one (``wants_local_inference``), and its addresses.
        setup: the attempt's job directory and log subdirectory.

    The ssh files a launch needs are described in the spec (``ssh_files``); ``launch``
    writes them.
    """
    usage = usage or check_usage(opts, flavor, selection, environ)  # prepare checked them already
    local_only = all_local(selection.hosts)
    include, exclude, reason, nccl = _interfaces(opts, usage, flavor, environ, local_only, choice, local.shared)
    if opts.include_iface or opts.exclude_iface:
        local_only = False
    launcher_addr = _launcher_address(flavor, selection, include, local)
    ssh_files = usage.ssh_files
    tag = opts.tag_output if opts.tag_output is not None else (len(selection.hosts) > 1 and not local_only)
    wrapper = (sys.executable, "-S", RANKEXEC, "--") if opts.rank_wrapper else ()
    master_addr, master_port = choose(selection.hosts, local_only, environ, dict(usage.env))
    return cmd.LaunchSpec(
        program=resolve_program(opts.program, environ),
        hosts=selection.hosts,
        np=usage.np,
        host_source=selection.source,
        oversubscribe=opts.oversubscribe,
        include_iface=include,
        exclude_iface=exclude,
        iface_reason=reason,
        local_only=local_only,
        env=tuple(opts.env),
        env_names_set=frozenset(k for k in environ
                                if environ.get(k) and (k in _ENV_NAMES_NOTED or k.startswith(_ENV_PREFIXES_NOTED))),
        mca=tuple(opts.mca),
        mpi_args=usage.mpi_args,
        tag_output=tag,
        log_dir=os.path.join(os.path.abspath(opts.log_dir), setup.run_id or new_run_id()) if opts.log_dir else None,
        job_dir=setup.job_dir,
        nccl_debug=opts.nccl_debug,
        nccl_socket_ifname=nccl if include else None,
        no_tree_spawn=opts.no_tree_spawn,
        ssh_config=ssh_files.config,
        ssh_wrapper=ssh_files.wrapper,
        ssh_control_path=setup.ssh_control_path,
        ssh_files=ssh_files.files,
        as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
        rank_wrapper=wrapper,
        host_ifaces=choice.host_ifaces if choice is not None else (),
        launcher_addr=launcher_addr,
        master_addr=master_addr,
        master_port=master_port,
        pin_gpus=opts.pin_gpus,
        horovod_alias=horovod_alias() if opts.horovod else None,
        inherited_pythonpath=environ.get("PYTHONPATH") if opts.horovod else None,
    )


def horovod_alias() -> str:
    """The folder --horovod puts first on the ranks' PYTHONPATH.

    Raises:
        LaunchError: this install of dtrun lacks it.
    """
    if not os.path.isfile(os.path.join(HOROVOD_ALIAS, "horovod", "__init__.py")):
        raise LaunchError(f"--horovod: dtrun's horovod alias package is missing from this install "
                          f"({HOROVOD_ALIAS}/horovod): reinstall dtrun")
    return HOROVOD_ALIAS


def local_facts(opts: LaunchOptions, flavor: Flavor, selection: HostSelection,
                choice: Optional[InterfaceChoice], environ: Mapping[str, str]) -> LocalFacts:
    """The I/O ``make_spec`` must not do: resolve the hosts and read this machine's interfaces,
    only where the launch needs them (DNS bounded by a timeout, shorter for a dry run)."""
    if all_local(selection.hosts):
        return LocalFacts()
    shared = None
    if wants_local_inference(opts, flavor, selection, choice, environ):
        shared = infer_shared_subnet([h.host for h in selection.hosts if not is_local(h.host)],
                                     DRY_RUN_RESOLVE_S if opts.dry_run else RESOLVE_TIMEOUT_S)
    return LocalFacts(shared, () if flavor.is_openmpi else tuple(local_addresses()))


@dataclass(frozen=True)
class PreparedLaunch:
    """Everything settled before a job starts: what ``--dry-run`` prints and a launch runs."""

    selection: HostSelection
    flavor: Flavor
    spec: cmd.LaunchSpec
    groups: list  # the command, as ArgGroup(args, why)
    launcher_choice: slurm.LauncherChoice  # srun or mpirun, and why (``choice`` is always the interfaces')


def prepare(opts: LaunchOptions, environ: Optional[Mapping[str, str]] = None,
            preflight: Optional[Preflight] = None, setup: AttemptSetup = AttemptSetup()) -> PreparedLaunch:
    """Resolve hosts and flavor, choose srun or mpirun, run the preflight, build the spec and the command.

    ``preflight`` (given by the CLI: ``checks.preflight.preflight``) checks the hosts of a
    multi-host launch and returns an ``InterfaceChoice`` or None; it raises when a host
    would hang the job. A dry run goes through the same steps, so it prints the command a
    real launch of the same arguments would run.
    """
    environ = os.environ if environ is None else environ
    selection = setup.selection or resolve_hosts(opts.hosts, environ)
    for w in selection.warnings:
        warn(w)
    flavor = detect_flavor(find_mpirun(opts.mpirun, environ), write_cache=not opts.dry_run)
    launcher_choice = slurm.choose_launcher(opts.launcher, flavor, selection.source == SLURM_SOURCE, environ)
    usage = check_usage(opts, flavor, selection, environ)  # before any network step: a usage error is not a host's
    choice = _preflight(opts, selection, flavor, launcher_choice, environ, preflight)
    spec = make_spec(opts, flavor, selection, environ, choice, local_facts(opts, flavor, selection, choice, environ),
                     setup, usage)
    if launcher_choice.launcher == "srun":
        groups = slurm.build_srun_groups(spec, flavor, launcher_choice.plugins,
                                         launcher_choice.allocation.cpus_per_task, launcher_choice.srun)
        return PreparedLaunch(selection, flavor, spec, groups, launcher_choice)
    if len(selection.hosts) > cmd.tree_radix(environ) and not spec.no_tree_spawn and flavor.is_openmpi:
        warn(f"{len(selection.hosts)} hosts: Open MPI spawns daemons through a tree, so inner hosts must ssh to "
             "others; pass --no-tree-spawn if only this host has ssh access to all")
    return PreparedLaunch(selection, flavor, spec, cmd.build_groups(spec, flavor), launcher_choice)


def _preflight(opts: LaunchOptions, selection: HostSelection, flavor: Flavor, launcher_choice,
               environ: Mapping[str, str], preflight: Optional[Preflight]) -> Optional[InterfaceChoice]:
    """Check the hosts of a multi-host launch: the interface choice the preflight returns, or None."""
    if not opts.preflight or all_local(selection.hosts):
        return None
    if launcher_choice.allocation is not None and selection.source == SLURM_SOURCE:
        # Inside the allocation Slurm starts everything (srun, or mpirun's daemons through
        # srun): many sites block ssh to compute nodes, so check the Slurm side instead.
        # It changes nothing in the command, so a dry run skips it.
        if not opts.dry_run:
            slurm.check_step(launcher_choice.srun or slurm.find_srun(environ) or "srun", selection.names)
        return None
    if preflight is not None:
        return preflight(opts, selection, flavor, environ)  # raises PreflightError on a known hang
    return None
