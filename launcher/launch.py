"""The launch command's work: options → hosts → MPI flavor → LaunchSpec → mpirun."""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from launcher import command as cmd
from launcher.errors import ExitCode, UsageError, signal_exit_code
from launcher.flavors import Flavor, detect_flavor, find_mpirun
from launcher.paths import cache_dir
from launcher.hosts import SLURM_SOURCE, HostSelection, all_local, is_local, resolve_hosts, resolve_np

RANKEXEC = str(Path(__file__).with_name("rankexec.py"))


@dataclass(frozen=True)
class LaunchOptions:
    """What the user asked for on the command line, before anything is resolved."""

    program: tuple[str, ...]
    np: Optional[int] = None
    host_list: Optional[str] = None
    hostfile: Optional[str] = None
    cluster: Optional[str] = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
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
    ssh_config: Optional[str] = None
    dry_run: bool = False
    rank_wrapper: bool = True
    preflight: bool = True  # check ssh and choose interfaces before a multi-host launch (checks/preflight.py)
    verbose: bool = False  # print the decisions (the --dry-run text) on stderr before launching
    # Set by the preflight, never from the command line: the interface choice and where it came from.
    iface_reason: Optional[str] = None
    nccl_socket_ifname: Optional[str] = None
    run_id: Optional[str] = None  # --log-dir: this run's subdirectory (default: time and pid)
    launcher: str = "auto"  # "srun", "mpirun", or srun inside an allocation when the MPI can (launcher/slurm.py)


def warn(msg: str) -> None:
    print(f"dtrun: warning: {msg}", file=sys.stderr)


def ssh_config_for(selection: HostSelection, base_config: Optional[str]) -> Optional[str]:
    """An ssh config that carries the cluster file's per-host user/port/identity.

    Returns ``base_config`` unchanged when no host has settings of its own; otherwise
    writes a small config (Host blocks, then ``Include`` of the base or ~/.ssh/config).
    """
    per_host = [h for h in selection.hosts if h.has_ssh_settings]
    if not per_host:
        return base_config
    lines = ["# written by dtrun from " + selection.source]
    for h in per_host:
        lines.append(f"Host {h.host}")
        if h.user:
            lines.append(f"  User {h.user}")
        if h.port:
            lines.append(f"  Port {h.port}")
        if h.identity_file:
            lines.append(f'  IdentityFile "{h.identity_file}"')
    include = base_config or os.path.expanduser("~/.ssh/config")
    if os.path.exists(include):
        lines += ["Host *", f'  Include "{os.path.abspath(include)}"']
    text = "\n".join(lines) + "\n"
    path = cache_dir() / "ssh" / f"config-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return str(path)


def mpich_ssh_wrapper(config: str) -> str:
    """Hydra takes an ssh executable, not ssh arguments: a two-line script that adds -F."""
    text = f"#!/bin/sh\nexec ssh -F {shlex.quote(config)} \"$@\"\n"
    path = cache_dir() / "ssh" / f"ssh-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_text(text)
        path.chmod(0o755)
    return str(path)


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


def _split_ifaces(value: str, flag: str) -> tuple[str, ...]:
    items = tuple(i.strip() for i in value.split(",") if i.strip())
    if not items:
        raise UsageError(f"{flag}: empty interface list")
    for i in items:
        if not all(c.isalnum() or c in "._-/:" for c in i):
            raise UsageError(f"{flag}: invalid interface or subnet {i!r}")
    return items


def exclusions(user: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """--exclude-iface adds to dtrun's default (lo, docker0); it never replaces it.

    Open MPI's btl_tcp_if_exclude replaces Open MPI's own default (which holds lo), and
    NCCL's '^' list excludes only what it names: without lo, both may pick loopback.
    """
    merged = tuple(dict.fromkeys(cmd.DEFAULT_EXCLUDE + tuple(user)))
    added = [i for i in merged if i not in cmd.DEFAULT_EXCLUDE]
    return merged, f"{', '.join(added) or 'nothing new'} from --exclude-iface, added to dtrun's default {','.join(cmd.DEFAULT_EXCLUDE)}"


def new_run_id(now: Optional[float] = None, pid: Optional[int] = None) -> str:
    """The subdirectory of --log-dir for one run: start time and dtrun's pid (sorts by time)."""
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{os.getpid() if pid is None else pid}"


def make_spec(opts: LaunchOptions, flavor: Flavor, selection: HostSelection,
              environ: Mapping[str, str]) -> cmd.LaunchSpec:
    """Settle every choice the command line depends on (pure apart from writing ssh configs)."""
    if not opts.program:
        raise UsageError("no program given: dtrun [OPTIONS] PROGRAM [ARGS...]")
    np = resolve_np(opts.np, selection, opts.oversubscribe)
    local_only = all_local(selection.hosts)
    for item in opts.env:
        cmd.parse_env_item(item)
    include, exclude, reason = (), cmd.DEFAULT_EXCLUDE, "default"
    if opts.include_iface and opts.exclude_iface:
        raise UsageError("--include-iface and --exclude-iface cannot be used together (Open MPI rejects both at once)")
    if opts.include_iface:
        include = _split_ifaces(opts.include_iface, "--include-iface")
        reason = opts.iface_reason or "--include-iface"
        local_only = False
    elif opts.exclude_iface:
        exclude, reason = exclusions(_split_ifaces(opts.exclude_iface, "--exclude-iface"))
        local_only = False
    elif not local_only and flavor.is_openmpi:
        from launcher.netinfo import infer_shared_subnet

        shared = infer_shared_subnet([h.host for h in selection.hosts if not is_local(h.host)])
        if shared is not None:
            include, reason = (shared.cidr,), (f"the subnet of {shared.iface} routes to every host, "
                                               "inferred on this machine (no preflight)")
    base_ssh = opts.ssh_config or environ.get("DTRUN_SSH_CONFIG") or selection.ssh_config
    if base_ssh and not os.path.isfile(base_ssh):
        raise UsageError(f"ssh config {base_ssh}: no such file")
    ssh_config = ssh_config_for(selection, base_ssh)
    tag = opts.tag_output if opts.tag_output is not None else (len(selection.hosts) > 1 and not local_only)
    wrapper = (sys.executable, "-S", RANKEXEC, "--") if opts.rank_wrapper else ()
    return cmd.LaunchSpec(
        program=resolve_program(opts.program, environ),
        hosts=selection.hosts,
        np=np,
        host_source=selection.source,
        oversubscribe=opts.oversubscribe,
        include_iface=include,
        exclude_iface=exclude,
        iface_reason=reason,
        local_only=local_only,
        env=tuple(opts.env),
        env_names_set=frozenset(k for k in ("LD_LIBRARY_PATH", "NCCL_SOCKET_IFNAME") if environ.get(k)),
        mca=tuple(opts.mca),
        mpi_args=tuple(shlex.split(opts.mpi_args)) if opts.mpi_args else (),
        tag_output=tag,
        log_dir=os.path.join(os.path.abspath(opts.log_dir), opts.run_id or new_run_id()) if opts.log_dir else None,
        nccl_debug=opts.nccl_debug,
        nccl_socket_ifname=opts.nccl_socket_ifname if include else None,
        no_tree_spawn=opts.no_tree_spawn,
        ssh_config=ssh_config,
        ssh_wrapper=mpich_ssh_wrapper(ssh_config) if ssh_config and not flavor.is_openmpi else None,
        as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
        rank_wrapper=wrapper,
    )


def prepare(opts: LaunchOptions, environ: Optional[Mapping[str, str]] = None):
    """Resolve hosts and flavor, run the preflight, build the spec and the argument groups.

    A dry run goes through the same steps (the preflight included), so it prints the
    command a real launch of the same arguments would run.
    """
    selection, flavor, spec, groups, _ = prepare_launch(opts, environ)
    return selection, flavor, spec, groups


def prepare_launch(opts: LaunchOptions, environ: Optional[Mapping[str, str]] = None):
    """As ``prepare``, plus the launcher choice (srun or mpirun, and why)."""
    from launcher import slurm

    environ = os.environ if environ is None else environ
    selection = resolve_hosts(opts.host_list, opts.hostfile, opts.cluster, opts.include, opts.exclude, environ)
    for w in selection.warnings:
        warn(w)
    flavor = detect_flavor(find_mpirun(opts.mpirun, environ))
    choice = slurm.choose_launcher(opts.launcher, flavor, selection.source == SLURM_SOURCE, environ)
    in_slurm = choice.allocation is not None and selection.source == SLURM_SOURCE
    if opts.preflight and not all_local(selection.hosts):
        if in_slurm:
            # Inside the allocation Slurm starts everything (srun, or mpirun's daemons through
            # srun): many sites block ssh to compute nodes, so check the Slurm side instead.
            # It changes nothing in the command, so a dry run skips it.
            if not opts.dry_run:
                slurm.check_step(choice.srun or slurm.find_srun(environ) or "srun", selection.names)
        else:
            from checks.preflight import preflight

            opts = preflight(opts, selection, flavor, environ)  # raises PreflightError on a known hang
    spec = make_spec(opts, flavor, selection, environ)
    if choice.launcher == "srun":
        groups = slurm.build_srun_groups(spec, flavor, choice.plugins, choice.allocation.cpus_per_task, choice.srun)
        return selection, flavor, spec, groups, choice
    if len(selection.hosts) >= cmd.TREE_SPAWN_HOSTS and not spec.no_tree_spawn and flavor.is_openmpi:
        warn(f"{len(selection.hosts)} hosts: Open MPI spawns daemons through a tree, so inner hosts must ssh to "
             "others; pass --no-tree-spawn if only this host has ssh access to all")
    return selection, flavor, spec, cmd.build_groups(spec, flavor), choice


def describe(opts: LaunchOptions, selection, flavor: Flavor, spec: cmd.LaunchSpec, groups, choice=None) -> str:
    """The --dry-run / --verbose text: what runs, each flag with its reason."""
    from launcher import slurm

    hosts = len(selection.hosts)
    if choice is not None and choice.launcher == "srun":
        header = slurm.format_header(choice, flavor, spec)
        notes = "".join(f"# note: {n}\n" for n in slurm.srun_notes(spec, flavor))
        return notes + cmd.format_dry_run(groups, header)
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
    return cmd.format_dry_run(groups, header)


def start_log_dir(log_dir: str) -> None:
    """Create this run's log directory and point DIR/latest at it (best effort for the link)."""
    os.makedirs(log_dir, exist_ok=True)
    latest = os.path.join(os.path.dirname(log_dir), "latest")
    try:
        tmp = f"{latest}.{os.getpid()}"
        os.symlink(os.path.basename(log_dir), tmp)
        os.replace(tmp, latest)
    except OSError:
        pass  # a file system without symlinks: the run's own directory is still there


def launch(opts: LaunchOptions) -> int:
    """Run (or with --dry-run, print) the job; return dtrun's exit code."""
    from launcher import slurm

    selection, flavor, spec, groups, choice = prepare_launch(opts)
    if opts.dry_run:
        print(describe(opts, selection, flavor, spec, groups, choice))
        return ExitCode.OK
    if opts.verbose:
        text = describe(opts, selection, flavor, spec, groups, choice)
        print("\n".join(f"dtrun: {line}" for line in text.splitlines()), file=sys.stderr, flush=True)
    elif choice.launcher == "srun":
        for n in slurm.srun_notes(spec, flavor):
            warn(n)
    from launcher.allocwatch import ended_message, ended_state, watch_allocation
    from launcher.run import failure_summary, run_job

    if spec.log_dir:
        start_log_dir(spec.log_dir)
    argv = [a for g in groups for a in g.args]
    stop_watch = watch_allocation(choice.allocation.job_id, environ=os.environ) if choice.allocation else None
    try:
        result = run_job(argv)
    finally:
        if stop_watch is not None:
            stop_watch()
    if choice.launcher == "srun":
        result.returncode = slurm.srun_exit_code(result)
    ended = ended_state(choice.allocation.job_id) if choice.allocation and not result.interrupted else None
    if ended:
        # Slurm stopped the ranks: that, not the first rank it killed, is the cause. Open MPI 5's
        # mpirun was seen to exit 0 when scancel killed its daemons' step; a killed job never exits 0.
        print(ended_message(choice.allocation.job_id, ended, "the job was stopped"), file=sys.stderr)
        return result.returncode or signal_exit_code(signal.SIGTERM)
    if result.returncode != 0:
        print(failure_summary(result, spec.log_dir), file=sys.stderr)
    return result.returncode
