"""The launch command's work: options → hosts → MPI flavor → LaunchSpec → mpirun."""
from __future__ import annotations

import os
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from dtrun.launcher import command as cmd
from dtrun.launcher.errors import ExitCode, LaunchError, UsageError, signal_exit_code
from dtrun.launcher.job import stopsignals
from dtrun.launcher.flavors import Flavor, detect_flavor, find_mpirun
from dtrun.launcher.hosts import SLURM_SOURCE, HostOptions, HostSelection, all_local, is_local, resolve_hosts
from dtrun.launcher.netinfo import InterfaceChoice, SharedSubnet, local_address_on
from dtrun.launcher.paths import new_run_id
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
    import math

    if value is None:
        return None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{flag} {value}: give a number of seconds above 0 (0 turns the limit off)")
    return value or None
# The preflight the CLI hands to ``launch``: (options, hosts, flavor, environ) -> choice or None.
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
    run_id: Optional[str] = None  # --log-dir: this run's subdirectory (default: time and pid)
    hang_timeout: Optional[float] = None  # report (or abort) after this many seconds without progress
    job_dir: Optional[str] = None  # set by launch(), never from the command line
    on_hang: str = "report"
    timeout: Optional[float] = None  # seconds the whole run may take, restarts included
    deadline: Optional[float] = None  # set by the restart loop: time.monotonic() when --timeout ends
    start_timeout: Optional[float] = DEFAULT_START_TIMEOUT_S  # seconds until every rank has started
    launcher: str = "auto"  # "srun", "mpirun", or srun inside an allocation when the MPI can (launcher/slurm.py)
    max_restarts: int = 0  # restart a failed job up to N times without the hosts that fail the check (launcher/restarts.py)
    min_np: Optional[int | str] = None  # a restarted job may go on with fewer ranks, down to this
    spares: Optional[str] = None  # hosts (-H syntax) a restarted job may use in place of lost ones
    top: bool = False  # --top: the live table of `dtrun top` on stderr while the job runs (launcher/straggler.py)
    selection: Optional[HostSelection] = None  # set by the restart loop (this attempt's hosts), never from the command line


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


def _user_sets_nccl_ifname(opts: LaunchOptions, environ: Mapping[str, str]) -> bool:
    return "NCCL_SOCKET_IFNAME" in environ or any(e.split("=", 1)[0] == "NCCL_SOCKET_IFNAME" for e in opts.env)


def _interfaces(opts: LaunchOptions, usage: Usage, flavor: Flavor, environ: Mapping[str, str], local_only: bool,
                choice: Optional[InterfaceChoice], shared: Optional[SharedSubnet]):
    """(include, exclude, reason, NCCL_SOCKET_IFNAME) from the user's flags (checked: ``usage``), else
    the preflight's choice, else the subnet inferred on this machine, else dtrun's default exclusions."""
    nccl = None
    if choice is not None and choice.include and choice.nccl and not opts.exclude_iface \
            and not _user_sets_nccl_ifname(opts, environ) and (opts.include_iface or choice.include) == choice.include:
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
_ENV_PREFIXES_NOTED = ("OMPI_MCA_coll_tuned_",)  # any coll/tuned setting of the user's keeps dtrun's rules off


def _launcher_address(flavor: Flavor, selection: HostSelection, include: tuple, local: LocalFacts) -> Optional[str]:
    """Hydra's -localhost: this host's address on the subnet named, else on the one guessed here."""
    if flavor.is_openmpi or all_local(selection.hosts):
        return None
    cidr = next((i for i in include if "/" in i), None) or (local.shared.cidr if local.shared else None)
    return local_address_on(cidr, local.addresses) if cidr else None


def make_spec(opts: LaunchOptions, flavor: Flavor, selection: HostSelection, environ: Mapping[str, str],
              choice: Optional[InterfaceChoice] = None, local: LocalFacts = LocalFacts(),
              usage: Optional[Usage] = None) -> cmd.LaunchSpec:
    """Settle every choice the command line depends on. Pure: no DNS, no ``ip``, no file written.

    Args:
        choice: the preflight's interface choice, applied unless the user chose interfaces.
        local: this machine's network (``prepare`` gathers it): the subnet guessed here,
            used when nobody chose one (``wants_local_inference``), and its addresses.

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
    from dtrun.launcher.rendezvous import choose

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
        log_dir=os.path.join(os.path.abspath(opts.log_dir), opts.run_id or new_run_id()) if opts.log_dir else None,
        job_dir=opts.job_dir,
        nccl_debug=opts.nccl_debug,
        nccl_socket_ifname=nccl if include else None,
        no_tree_spawn=opts.no_tree_spawn,
        ssh_config=ssh_files.config,
        ssh_wrapper=ssh_files.wrapper,
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
    from dtrun.launcher.netinfo import DRY_RUN_RESOLVE_S, RESOLVE_TIMEOUT_S, infer_shared_subnet, local_addresses

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
    choice: object  # launcher.slurm's launcher choice: srun or mpirun, and why


def prepare(opts: LaunchOptions, environ: Optional[Mapping[str, str]] = None,
            preflight: Optional[Preflight] = None) -> PreparedLaunch:
    """Resolve hosts and flavor, choose srun or mpirun, run the preflight, build the spec and the command.

    ``preflight`` (given by the CLI: ``checks.preflight.preflight``) checks the hosts of a
    multi-host launch and returns an ``InterfaceChoice`` or None; it raises when a host
    would hang the job. A dry run goes through the same steps, so it prints the command a
    real launch of the same arguments would run.
    """
    from dtrun.launcher import slurm

    environ = os.environ if environ is None else environ
    selection = opts.selection or resolve_hosts(opts.hosts, environ)
    for w in selection.warnings:
        warn(w)
    flavor = detect_flavor(find_mpirun(opts.mpirun, environ), write_cache=not opts.dry_run)
    launcher_choice = slurm.choose_launcher(opts.launcher, flavor, selection.source == SLURM_SOURCE, environ)
    usage = check_usage(opts, flavor, selection, environ)  # before any network step: a usage error is not a host's
    choice = _preflight(opts, selection, flavor, launcher_choice, environ, preflight)
    spec = make_spec(opts, flavor, selection, environ, choice, local_facts(opts, flavor, selection, choice, environ),
                     usage)
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
    from dtrun.launcher import slurm

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


def describe(opts: LaunchOptions, selection, flavor: Flavor, spec: cmd.LaunchSpec, groups, notes=(),
             choice=None) -> str:
    """The --dry-run / --verbose text: what runs, each flag with its reason."""
    from dtrun.launcher import slurm

    hosts = len(selection.hosts)
    if choice is not None and choice.launcher == "srun":
        return cmd.format_dry_run(groups, slurm.format_header(choice, flavor, spec), slurm.srun_notes(spec, flavor))
    header = (f"{flavor.label} ({flavor.mpirun}); {spec.np} ranks on {hosts} host{'s' if hosts != 1 else ''} "
              f"from {selection.source}")
    if choice is not None and choice.allocation is not None:
        header += f"; mpirun, not srun: {choice.reason}"
    if spec.local_only:
        header += "; every host is this machine, so no interface flags"
    elif not opts.preflight:
        header += "; --no-preflight: interfaces not checked on the hosts"
    if spec.log_dir:
        header += f"; rank logs in {spec.log_dir}"
    return cmd.format_dry_run(groups, header, notes)


def start_log_dir(log_dir: str) -> None:
    """Create this run's log directory, new and private (mode 0700), and point DIR/latest at it.

    A directory of that name that exists already (another run's, or one planted in a shared
    DIR) is refused, never written into. DIR/latest is replaced by a rename, never followed,
    and is skipped where it cannot be made (a file system without symlinks, a directory
    of that name): the run's own directory is what counts.
    """
    import secrets

    parent, name = os.path.split(log_dir)
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--log-dir {parent}: cannot create it: {exc.strerror}") from None
    try:
        os.mkdir(log_dir, 0o700)
    except FileExistsError:
        raise UsageError(f"--log-dir: {log_dir} exists already: each run writes into a new directory that it "
                         "creates itself, never into one made by another run or another user") from None
    except OSError as exc:
        raise UsageError(f"--log-dir: cannot create {log_dir}: {exc.strerror}") from None
    try:
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    tmp = f".latest.{secrets.token_hex(6)}"
    try:
        os.symlink(name, tmp, dir_fd=dfd)
        try:
            os.replace(tmp, "latest", src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            os.unlink(tmp, dir_fd=dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def launch(opts: LaunchOptions, preflight: Optional[Preflight] = None, host_check=None) -> int:
    """Run (or with --dry-run, print) the job; return dtrun's exit code (``preflight``: see ``prepare``).

    ``host_check`` (given by the CLI: ``checks.hostcheck.check_hosts``) checks the hosts after
    a failure: those that fail it are named, and left out of a restart (launcher/restarts.py).
    """
    from dtrun.launcher.hangwatch import ON_HANG

    if opts.hang_timeout is not None and not opts.hang_timeout > 0:
        raise UsageError(f"--hang-timeout {opts.hang_timeout:g}: give a number of seconds above 0")
    if opts.on_hang not in ON_HANG:
        raise UsageError(f"--on-hang {opts.on_hang!r}: use one of {', '.join(ON_HANG)}")
    check_seconds(opts.timeout, "--timeout")
    check_seconds(opts.start_timeout, "--start-timeout")
    if opts.dry_run or not opts.rank_wrapper:
        from dtrun.launcher.restarts import check_options

        check_options(opts, None)
        return _launch(opts, None, preflight)
    from dtrun.launcher import restarts

    # One attempt, or with --max-restarts several, each in a job directory of its own where
    # ranks leave state for `dtrun stacks` (launcher/remote/rankstate.py).
    return restarts.run(opts, _attempt, preflight, host_check)


def _launch(opts: LaunchOptions, job_dir: Optional[str], preflight: Optional[Preflight]) -> int:
    return _attempt(opts, job_dir, preflight).code


def _attempt(opts: LaunchOptions, job_dir: Optional[str], preflight: Optional[Preflight], observers=(),
             cleanup: bool = True):
    """Run one attempt of the job: a ``launcher.restarts.Attempt`` (dtrun's exit code, the result,
    the hosts). ``cleanup=False`` leaves the clean-up after a failure to the restart loop,
    which first checks the hosts (a signal still cleans up here)."""
    import time

    from dtrun.launcher.restarts import Attempt

    prepared = prepare(opts, preflight=preflight)
    selection, spec, choice = prepared.selection, prepared.spec, prepared.choice
    if opts.dry_run:
        print(dry_run_text(opts, prepared))
        return Attempt(ExitCode.OK)
    _before_start(opts, prepared)
    from dtrun.launcher.allocwatch import watch_allocation
    from dtrun.launcher.job.result import expected_hosts
    from dtrun.launcher.job.summary import failure_summary
    from dtrun.launcher.job.supervisor import run_job

    sweep = _sweeps_session_dirs(prepared)
    observers, monitor = _observers(opts, prepared, job_dir, tuple(observers), sweep)
    expected = expected_hosts(spec.hosts, spec.np) if spec.rank_wrapper else []
    stop_watch = watch_allocation(choice.allocation.job_id, environ=os.environ) if choice.allocation else None
    started = time.monotonic()
    # A stop signal from mpirun's start to the end of the clean-up is the supervisor's, or
    # waits for the clean-up to finish (launcher.job.stopsignals): nothing is left running.
    with stopsignals.held():
        try:
            result = run_job([a for g in prepared.groups for a in g.args], timeout=_time_left(opts),
                             timeout_limit=check_seconds(opts.timeout, "--timeout"),
                             start_timeout=check_seconds(opts.start_timeout, "--start-timeout"), expected=expected,
                             monitor=monitor, observers=observers)
        finally:
            if stop_watch is not None:
                stop_watch()
        attempt = Attempt(0, result, tuple(expected_hosts(spec.hosts, spec.np)), tuple(h.host for h in spec.hosts),
                          monitor.job if monitor is not None else None, srun=choice.launcher == "srun",
                          in_slurm=choice.allocation is not None, elapsed=time.monotonic() - started,
                          selection=selection, nspace=monitor.nspace if monitor is not None else "")
        attempt.cleaned = cleanup or result.interrupted
        _clean_up(prepared, result, monitor, attempt.cleaned, sweep)
        if _ended_by_slurm(prepared, result, attempt):
            return attempt
        if tree_spawn_failure(result, spec, prepared.flavor, len(selection.hosts), choice.launcher):
            result.notes.append(tree_spawn_note(len(selection.hosts)))
        if result.returncode != 0 or result.notes:
            print(failure_summary(result, spec.log_dir, opts.on_hang), file=sys.stderr)
        attempt.code = result.returncode
    return attempt


def _time_left(opts: LaunchOptions) -> Optional[float]:
    """Seconds this attempt may run: what is left of the run's --timeout (restarts share it)."""
    import time

    limit = check_seconds(opts.timeout, "--timeout")
    if limit is None or opts.deadline is None:
        return limit
    return max(opts.deadline - time.monotonic(), 0.0)


def _notes(prepared: PreparedLaunch) -> list[str]:
    """The warnings of this MPI (or srun) for this spec, shown before the job and in --dry-run."""
    from dtrun.launcher import slurm

    if prepared.choice.launcher == "srun":
        return slurm.srun_notes(prepared.spec, prepared.flavor)
    return cmd.flavor_notes(prepared.spec, prepared.flavor)


def dry_run_text(opts: LaunchOptions, prepared: PreparedLaunch) -> str:
    """What --dry-run prints: the command with its reasons, then the ssh files a launch would write."""
    lines = [describe(opts, prepared.selection, prepared.flavor, prepared.spec, prepared.groups, _notes(prepared),
                      prepared.choice)]
    for f in prepared.spec.ssh_files:
        lines.append(f"# a launch first writes {f.path} (--dry-run wrote nothing):")
        lines.append("\n".join(f"#   {line}" for line in f.text.splitlines()))
    return "\n".join(lines)


def _before_start(opts: LaunchOptions, prepared: PreparedLaunch) -> None:
    """--verbose's account, the ssh files, the MPI's warnings and the log directory."""
    notes = _notes(prepared)
    if opts.verbose:
        text = describe(opts, prepared.selection, prepared.flavor, prepared.spec, prepared.groups, notes,
                        prepared.choice)
        print("\n".join(f"dtrun: {line}" for line in text.splitlines()), file=sys.stderr, flush=True)
    for f in prepared.spec.ssh_files:
        f.write()
    for n in notes:
        warn(n)
    if prepared.spec.log_dir:
        start_log_dir(prepared.spec.log_dir)


def _sweeps_session_dirs(prepared: PreparedLaunch) -> bool:
    """Whether to clear this host's stale Open MPI 5 session directories before and after the job.

    Open MPI 5 refuses to start an mpirun or daemon whose pid a killed job's session
    directory still names (launcher/remote/sessiondirs.py).
    """
    flavor = prepared.flavor
    sweep = flavor.is_openmpi and flavor.major >= 5 and prepared.choice.launcher != "srun"
    if sweep:
        from dtrun.launcher.remote import sessiondirs

        sessiondirs.sweep()
    return sweep


def _observers(opts: LaunchOptions, prepared: PreparedLaunch, job_dir: Optional[str], observers: tuple,
               sweep: bool):
    """(the job's observers, the hang monitor or None): what watches the job beside run_job."""
    if sweep:
        from dtrun.launcher.remote import sessiondirs

        # mpirun's own directory is locked while it runs: only then may a sweep from any pid
        # namespace that shares this temporary directory tell it from a killed job's.
        observers += (sessiondirs.LauncherLock(),)
    if job_dir is None:
        return observers, None
    from dtrun.launcher import jobstate
    from dtrun.launcher.hangwatch import Monitor
    from dtrun.launcher.straggler import StragglerWatch
    from dtrun.launcher.top import live_table

    spec = prepared.spec
    job = jobstate.write(job_dir, [h.host for h in prepared.selection.hosts], spec.np, spec.ssh_config, spec.log_dir,
                         prepared.flavor.label, spec.program)
    # Reaping a job's stuck daemons after its end goes over ssh; inside a Slurm allocation
    # the daemons ran as a Slurm step, which Slurm ends itself (and ssh may be blocked there).
    monitor = Monitor(job, opts.hang_timeout, opts.on_hang,
                      reap_daemons=sweep and prepared.choice.allocation is None)
    return observers + (StragglerWatch(job, table=live_table if opts.top else None),), monitor  # the straggler finding at the end


def _clean_up(prepared: PreparedLaunch, result, monitor, cleanup: bool, sweep: bool) -> None:
    """Stop what a stopped job left on the hosts, sweep session directories, set srun's exit code."""
    srun = prepared.choice.launcher == "srun"
    if cleanup and monitor is not None and (result.hung or (result.stopped and not srun)):
        # Nothing of a job dtrun stopped may stay behind on any host: an MPI daemon can outlive
        # an mpirun that had to be killed (Open MPI 5's prted on a loaded machine does).
        # Under srun, Slurm ends the step's processes itself (and ssh may be blocked there).
        # A signal leaves little time (dtrun exits within about 5 s of SIGTERM); a time limit
        # or --on-hang abort more.
        monitor.kill_leftovers(budget=1.5 if result.interrupted else 5.0)
    if sweep:
        from dtrun.launcher.remote import sessiondirs

        removed = sessiondirs.sweep()
        if result.pmix_refused:
            result.notes.append(pmix_refused_note(result.pmix_refused, len(removed)))
    if srun:
        from dtrun.launcher import slurm

        result.returncode = slurm.srun_exit_code(result)


def _ended_by_slurm(prepared: PreparedLaunch, result, attempt) -> bool:
    """Whether Slurm ended the allocation under the job; if so, say so and set the attempt's code."""
    from dtrun.launcher.allocwatch import ended_message, ended_state

    allocation = prepared.choice.allocation
    ended = ended_state(allocation.job_id) if allocation and not result.interrupted else None
    if not ended:
        return False
    # Slurm stopped the ranks: that, not the first rank it killed, is the cause, and the code
    # is SIGTERM's, as Slurm stops jobs. What mpirun itself returns then is happenstance: 0
    # (Open MPI 5, when scancel killed its daemons' step), 1 (it lost a daemon first) or 143.
    print(ended_message(allocation.job_id, ended, "the job was stopped"), file=sys.stderr)
    attempt.code, attempt.ended = signal_exit_code(signal.SIGTERM), True
    return True


def pmix_refused_note(host: str, removed: int) -> str:
    """The failure summary's note when PMIx would not start on ``host`` and no rank started."""
    return (f"Open MPI's PMIx would not start on {host} and no rank started: the usual cause is "
            "a session directory that a killed job left in that host's temporary directory (ompi.PID, prted.PID) "
            "naming the pid the new mpirun or daemon was given, which PMIx 5.0 does not reclaim. dtrun removes "
            "such directories on this machine at every launch" + (f" ({removed} just now)" if removed else "")
            + " and each host's rank wrapper removes them during every job: run the job again (a new daemon "
            "gets a new pid)")


def tree_spawn_note(hosts: int) -> str:
    """The failure summary's note when mpirun failed silently before any rank under tree spawn."""
    return (f"{hosts} hosts: Open MPI's daemons start each other over ssh (tree spawn), and mpirun "
            "failed before any rank started; a host that cannot ssh to its children fails a launch this way "
            "(Open MPI 5 says nothing about it, 4.1 prints the ssh error with the child's address only): "
            "`dtrun doctor` names the pair, --no-tree-spawn starts every daemon from this host")


def tree_spawn_failure(result, spec: cmd.LaunchSpec, flavor: Flavor, hosts: int, launcher: str) -> bool:
    """Whether mpirun failed silently, before any rank, on a launch that used Open MPI's tree spawn."""
    return (result.returncode != 0 and launcher != "srun" and flavor.is_openmpi and not spec.no_tree_spawn
            and hosts > cmd.tree_radix(os.environ) and not result.failures and not result.interrupted
            and not result.timeout and not result.hung and not result.vanished and not result.lost_daemon_host
            and not result.stdout_closed)
