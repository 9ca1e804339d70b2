"""The dtrun command line: parse, build one options object, hand it on. Nothing else.

``dtrun [OPTIONS] PROGRAM [ARGS...]`` launches; ``dtrun hosts|smoke|bench|doctor|keyscan|completion``
are subcommands. Only typer and the standard library are imported here; the commands
import what they need (rich, paramiko, mpi4py) when they run.
"""
from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from typing import List, Optional

import typer

from dtrun.launcher.errors import DtrunError, ExitCode, UsageError, signal_name
from dtrun.launcher.job import stopsignals
from dtrun.launcher.optargs import LaunchArgv, no_such_option, option_table, read_launch_argv
from dtrun.launcher.toolargs import TOOLS, tool_launch_argv

SUBCOMMANDS = ("hosts", "smoke", "bench", "doctor", "keyscan", "completion", "stacks", "top")

run_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
sub_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                      no_args_is_help=True)

_H = typer.Option(None, "-H", "--host", help="Hosts and slots: server1:4,server2:4 (a bare host is 1 slot).")
_HOSTFILE = typer.Option(None, "--hostfile", "-f", help="Open MPI ('host slots=N') or MPICH ('host:N') hostfile.")
_CLUSTER = typer.Option(None, "--cluster", help="YAML cluster file (per-host slots, user, port, identity_file).")
_INCLUDE = typer.Option([], "--include", help="Only these hosts (comma-separated, repeatable).")
_EXCLUDE = typer.Option([], "--exclude", help="Leave out these hosts (comma-separated, repeatable).")
_SSH_CONFIG = typer.Option(None, "--ssh-config", help="ssh config file for reaching the hosts (also $DTRUN_SSH_CONFIG).")
# Declared for --help, completion and the option table; its values never reach click (one value per
# option there): optargs.read_launch_argv reads the pairs and the command takes them from ctx.obj.
_MCA = typer.Option([], "--mca", help="Open MPI MCA parameter: --mca KEY VALUE (repeatable).", metavar="KEY VALUE")


def _show_version(value: bool) -> None:
    if value:
        from dtrun.launcher.version import version_text  # lazy: detecting the MPI, only --version needs it

        print(version_text())
        raise typer.Exit(0)


_PROGRAM = typer.Argument(None, help="The program and its arguments (never parsed by dtrun).", metavar="PROGRAM [ARGS]...")
_NP = typer.Option(None, "-np", "-n", "--np", metavar="N", help="Number of ranks (default: total slots).")


@run_app.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    epilog="Subcommands: dtrun hosts | smoke | bench | doctor | keyscan | completion | stacks | top (each with --help).",
)
def run(
    ctx: typer.Context,
    program: List[str] = _PROGRAM,
    np: Optional[str] = _NP,
    host_list: Optional[str] = _H,
    hostfile: Optional[str] = _HOSTFILE,
    cluster: Optional[str] = _CLUSTER,
    include: List[str] = _INCLUDE,
    exclude: List[str] = _EXCLUDE,
    oversubscribe: bool = typer.Option(False, "--oversubscribe", help="Allow more ranks than slots."),
    include_iface: Optional[str] = typer.Option(None, "--include-iface", help="Use only this interface or CIDR subnet for MPI/NCCL TCP."),
    exclude_iface: Optional[str] = typer.Option(None, "--exclude-iface", help="Avoid these interfaces (default lo,docker0)."),
    env: List[str] = typer.Option([], "-x", help="Forward NAME, or set NAME=VALUE, on every rank (repeatable)."),
    mca: List[str] = _MCA,
    mpi_args: Optional[str] = typer.Option(None, "--mpi-args", help="Extra mpirun arguments, passed unchanged."),
    tag_output: Optional[bool] = typer.Option(None, "--tag-output/--no-tag-output", help="Prefix output lines with the rank (default: on for multi-host)."),
    log_dir: Optional[str] = typer.Option(None, "--log-dir", help="Write each rank's output to DIR/rank.N.log."),
    nccl_debug: Optional[str] = typer.Option(None, "--nccl-debug", help="Set NCCL_DEBUG=LEVEL on every rank (e.g. INFO, WARN)."),
    no_tree_spawn: bool = typer.Option(False, "--no-tree-spawn", help="Start all remote daemons from this host (Open MPI)."),
    pin_gpus: bool = typer.Option(False, "--pin-gpus", help="Show each rank one GPU (CUDA_VISIBLE_DEVICES = local rank modulo the GPUs), for programs that do not pick one."),
    horovod: bool = typer.Option(False, "--horovod", help="Run an unchanged Horovod script on dtrun's adapter: in this job only, `import horovod.torch` (.tensorflow, .keras) loads dtrun.collectives.horovod."),
    mpirun: Optional[str] = typer.Option(None, "--mpirun", help="The mpirun/mpiexec to use (default: the one in this environment, then PATH)."),
    launcher: str = typer.Option("auto", "--launcher", help="srun or mpirun (default: srun inside a Slurm allocation when the MPI supports it)."),
    ssh_config: Optional[str] = _SSH_CONFIG,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the mpirun command with the reason for each flag; run nothing."),
    no_preflight: bool = typer.Option(False, "--no-preflight", help="Skip the check of ssh and interfaces before a multi-host launch."),
    verbose: bool = typer.Option(False, "--verbose", help="Before launching, print what dtrun decided and why (the --dry-run text, on stderr)."),
    hang_timeout: Optional[float] = typer.Option(None, "--hang-timeout", help="Report every rank's stack when no rank makes progress for S seconds.", metavar="S"),
    on_hang: str = typer.Option("report", "--on-hang", help="After the hang report: 'report' (the job goes on), 'abort' (stop it, exit 125) or 'restart' (stop it; --max-restarts starts it again)."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="Restart a failed job up to N times, leaving out hosts that fail a check (exit 123 when all fail).", metavar="N"),
    min_np: Optional[str] = typer.Option(None, "--min-np", help="With --max-restarts: go on with fewer ranks, down to M, when hosts are lost and no spare is left.", metavar="M"),
    spares: Optional[str] = typer.Option(None, "--spares", help="With --max-restarts: hosts (host:slots,...) that take the place of lost ones.", metavar="HOSTS"),
    host_discovery_script: Optional[str] = typer.Option(None, "--host-discovery-script", help="An executable that prints the hosts the job may use now, one host:slots per line (horovodrun's format): hosts it adds join the job at its next hvd.elastic commit, hosts it drops leave. Implies --max-restarts 3 unless given.", metavar="SCRIPT"),
    max_np: Optional[str] = typer.Option(None, "--max-np", help="With --host-discovery-script: the most ranks the job grows to.", metavar="N"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Stop the job after this many seconds, counted across --max-restarts attempts (exit 124)."),
    start_timeout: float = typer.Option(120.0, "--start-timeout", help="Stop the job if some ranks have not started after this many seconds, naming their hosts (exit 124; 0: no limit)."),
    top: bool = typer.Option(False, "--top", help="Show the live per-rank table of `dtrun top` on stderr while the job runs."),
    # Declared for --help and parsing; main reads it from argv before typer runs (read_invocation).
    traceback: bool = typer.Option(False, "--traceback", help="Show the Python traceback of an error."),
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print dtrun's version and the MPI it would use, then exit."),
):
    """Launch PROGRAM on the hosts with mpirun, with the flags experienced users add by hand."""
    from dtrun.launcher.launch import LaunchOptions  # lazy: the launch pipeline, not for --help/--version
    from dtrun.launcher.run import launch  # lazy: the launch pipeline, not for --help/--version

    hosts = _host_options(dict(host_list=host_list, hostfile=hostfile, cluster=cluster, include=include,
                               exclude=exclude), ssh_config)
    opts = LaunchOptions(
        program=tuple(program or ()), np=np, hosts=hosts, oversubscribe=oversubscribe,
        include_iface=include_iface, exclude_iface=exclude_iface, env=tuple(env), mca=ctx.obj.mca if ctx.obj else (),
        mpi_args=mpi_args, tag_output=tag_output, log_dir=log_dir, nccl_debug=nccl_debug,
        no_tree_spawn=no_tree_spawn, mpirun=mpirun, dry_run=dry_run, preflight=not no_preflight, verbose=verbose,
        hang_timeout=hang_timeout, on_hang=on_hang, timeout=timeout, start_timeout=start_timeout, max_np=max_np,
        pin_gpus=pin_gpus, horovod=horovod, launcher=launcher, max_restarts=max_restarts, min_np=min_np, spares=spares, top=top,
        host_discovery_script=host_discovery_script)
    # lazy: the ssh checks, only a launch needs them. The one place that joins launcher/ and checks/.
    from dtrun.checks.hostcheck import check_hosts
    from dtrun.checks.preflight import preflight  # lazy: as above
    raise typer.Exit(launch(opts, preflight, check_hosts))


# The options that choose the hosts, declared once for the commands that take them: the
# sources (-H, --hostfile, --cluster), then --include and --exclude.
_HOST_SOURCES = (("host_list", Optional[str], _H), ("hostfile", Optional[str], _HOSTFILE),
                 ("cluster", Optional[str], _CLUSTER))
_HOST_OPTIONS = _HOST_SOURCES + (("include", List[str], _INCLUDE), ("exclude", List[str], _EXCLUDE))


def _with_host_options(command, options=_HOST_OPTIONS):
    """Declare the host options first on ``command``, which takes them as ``**hosts`` (see _host_options)."""
    sig = inspect.signature(command, eval_str=True)
    own = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
             for name, kind, option in options]
    command.__signature__ = sig.replace(parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                                                    for p in added + own])
    return command


def _with_host_sources(command):
    """Declare -H, --hostfile and --cluster (not --include/--exclude) on ``command``, as ``**hosts``."""
    return _with_host_options(command, _HOST_SOURCES)


def _host_options(hosts: dict, ssh_config: Optional[str] = None):
    """The host options as typed (``**hosts``), and --ssh-config where the command has it, as one HostOptions."""
    from dtrun.launcher.hosts import HostOptions  # lazy: hostfile parsing (11 ms), not for --help/--version

    return HostOptions(host_list=hosts["host_list"], hostfile=hosts["hostfile"], cluster=hosts["cluster"],
                       include=tuple(hosts.get("include", ())), exclude=tuple(hosts.get("exclude", ())),
                       ssh_config=ssh_config)


@sub_app.command("hosts")
@_with_host_options
def hosts_cmd(
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    **hosts,
):
    """Print the resolved hosts and slots."""
    from dtrun.launcher.hostsview import HostsQuery, show_hosts  # lazy: rich, only this command

    raise typer.Exit(show_hosts(HostsQuery(hosts=_host_options(hosts), json_out=json_out)))


_TIMEOUT = typer.Option(5.0, "--timeout", help="Seconds each network step (connect, handshake, probe) may take.")


@sub_app.command("doctor")
@_with_host_options
def doctor_cmd(
    ssh_config: Optional[str] = _SSH_CONFIG,
    timeout: float = _TIMEOUT,
    json_out: bool = typer.Option(False, "--json", help="Print the findings as JSON (for CI)."),
    all_pairs: bool = typer.Option(False, "--all-pairs", help="Also check ssh from every host to every other."),
    program: Optional[str] = typer.Option(None, "--program", help="A script that must exist at the same path on every host."),
    no_e2e: bool = typer.Option(False, "--no-e2e", help="Skip the end-to-end job."),
    e2e_timeout: Optional[float] = typer.Option(None, "--e2e-timeout", help="Seconds the end-to-end job may take before it counts as a hang (default 40)."),
    links: bool = typer.Option(False, "--links", help="Measure bandwidth and latency between hosts (all pairs up to 8 hosts, else a ring and a sample) and name the slow host or pair."),
    links_sample_text: Optional[str] = typer.Option(None, "--links-sample", help="With --links: random host pairs to measure beyond the ring (default: as many as hosts; 0 for the ring only)."),
    **hosts,
):
    """Check ssh, environment, network, firewall and GPUs on every host; say what to fix."""
    from dtrun.checks.doctor import DoctorSpec, links_sample, run_doctor  # lazy: every check, only this command

    raise typer.Exit(run_doctor(DoctorSpec(
        hosts=_host_options(hosts, ssh_config), timeout=timeout, json=json_out, all_pairs=all_pairs, program=program, e2e=not no_e2e,
        e2e_timeout=e2e_timeout, links=links, links_sample=links_sample(links_sample_text, links))))


@sub_app.command("keyscan")
@_with_host_sources
def keyscan_cmd(
    names: List[str] = typer.Argument(None, help="Host names (comma-separated or several).", metavar="[HOSTS]..."),
    ssh_config: Optional[str] = _SSH_CONFIG,
    timeout: float = _TIMEOUT,
    yes: bool = typer.Option(False, "--yes", "-y", help="Add unknown keys without asking (for scripts)."),
    **hosts,
):
    """Show each host's SSH key fingerprint and add unknown keys to known_hosts after confirmation."""
    from dtrun.checks.keyscan import KeyscanSpec, keyscan  # lazy: ssh (paramiko), only this command

    spec = KeyscanSpec(names=tuple(names or ()), hosts=_host_options(hosts, ssh_config), timeout=timeout, yes=yes)
    raise typer.Exit(keyscan(spec))


@sub_app.command("stacks")
def stacks_cmd(
    job: Optional[str] = typer.Argument(None, help="The job's id or dtrun pid (needed when several run)."),
    timeout: float = typer.Option(5.0, "--timeout", help="Seconds each host may take to answer."),
):
    """Print every rank's stack of a running dtrun job, grouped; the job goes on."""
    from dtrun.launcher.stackscmd import show_stacks  # lazy: the job and agent modules, only this command

    raise typer.Exit(show_stacks(job, timeout))


@sub_app.command("top")
def top_cmd(
    job: Optional[str] = typer.Argument(None, help="The job's id or dtrun pid (needed when several run)."),
    once: bool = typer.Option(False, "--once", help="Print one table (or JSON object) and exit."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table (one object per refresh)."),
    interval: Optional[float] = typer.Option(None, "--interval", help="Seconds each refresh measures, 1 to 60 (default 1; 3 with --once)."),
    timeout: float = typer.Option(5.0, "--timeout", help="Seconds a host may take to connect before it is named."),
):
    """A live table of a running job per rank: rate, waiting, CPU, memory, GPU, the straggler; the job goes on."""
    from dtrun.launcher.top import TopSpec, show_top  # lazy: rich's live table, only this command

    raise typer.Exit(show_top(TopSpec(job=job, once=once, json_out=json_out, interval=interval, timeout=timeout)))


_LAUNCH_TABLE: dict = {}


def launch_table() -> dict[str, int]:
    if not _LAUNCH_TABLE:
        import typer.main

        _LAUNCH_TABLE.update(option_table(typer.main.get_command(run_app)))
    return _LAUNCH_TABLE


COMPLETE_VAR = "_DTRUN_COMPLETE"
_SHELLS = ("bash", "zsh", "fish")


@sub_app.command("completion")
def completion_cmd(
    shell: Optional[str] = typer.Argument(None, help="bash, zsh or fish (default: from $SHELL)."),
    install: bool = typer.Option(False, "--install", help="Add it to the shell's start-up files instead of printing it."),
):
    """Print (or --install) the shell completion script for dtrun.

    bash: eval "$(dtrun completion bash)" in ~/.bashrc, or dtrun completion --install.
    """
    shell = shell or os.path.basename(os.environ.get("SHELL", ""))
    if shell not in _SHELLS:
        raise UsageError(f"completion: unknown shell {shell!r}; choose one of {', '.join(_SHELLS)}")
    from typer import _completion_shared as shared

    if install:
        path = shared.install(shell=shell, prog_name="dtrun", complete_var=COMPLETE_VAR)[1]
        print(f"dtrun: {shell} completion installed in {path}; open a new shell to use it")
    else:
        print(shared.get_completion_script(prog_name="dtrun", complete_var=COMPLETE_VAR, shell=shell))


def _complete(instruction: str) -> int:
    """Answer the shell's completion request: subcommand names and options, or the launch options."""
    import typer.main
    from typer import _completion_classes
    from typer._click.shell_completion import CompletionItem, get_completion_class

    _completion_classes.completion_init()
    cls = get_completion_class(instruction.partition("_")[2])
    if cls is None:
        return ExitCode.USAGE
    launch = typer.main.get_command(run_app)
    subs = typer.main.get_command(sub_app)
    args, incomplete = cls(launch, {}, "dtrun", COMPLETE_VAR).get_completion_args()
    if args and args[0] in SUBCOMMANDS:
        tool = args[0] in TOOLS
        print(cls(launch if tool else subs, {}, "dtrun", COMPLETE_VAR).complete())
    elif not args and not incomplete.startswith("-"):
        comp = cls(subs, {}, "dtrun", COMPLETE_VAR)
        print("\n".join(comp.format_completion(CompletionItem(n)) for n in SUBCOMMANDS if n.startswith(incomplete)))
    else:
        print(cls(launch, {}, "dtrun", COMPLETE_VAR).complete())
    return ExitCode.OK


def _invoke(app: typer.Typer, argv: list[str], prog: str, launch: Optional[LaunchArgv] = None) -> int:
    from typer._click import exceptions as click_exc

    try:
        rv = app(args=argv, prog_name=prog, standalone_mode=False, obj=launch)
        return int(rv or 0)
    except typer.Exit as e:
        return int(e.exit_code)
    except click_exc.NoSuchOption as e:  # a subcommand's options: the same message as the launch command's
        print(f"dtrun: error: {no_such_option(e.option_name, e.possibilities or ())}", file=sys.stderr)
        return ExitCode.USAGE
    except click_exc.ClickException as e:  # usage errors: one line, exit 2
        print(f"dtrun: error: {e.format_message()}", file=sys.stderr)
        return ExitCode.USAGE if e.exit_code == 2 else int(e.exit_code)
    except typer.Abort:
        return ExitCode.INTERRUPTED


@dataclass(frozen=True)
class Invocation:
    """What main knows from argv before typer parses it: the launch command's argv, read once."""

    traceback: bool = False
    launch: Optional[LaunchArgv] = None  # None for a subcommand or a tool (dtrun smoke|bench)


def read_invocation(argv: list[str]) -> Invocation:
    """Read ``--traceback`` up front (as httpie does), with the launch command's whole argv.

    Only the launch options count (``dtrun [OPTIONS] PROGRAM``, ``dtrun smoke|bench``): a
    ``--traceback`` after PROGRAM or ``--`` is the program's. Reading it before typer runs
    means an error raised while the options are parsed shows its traceback too.
    """
    if argv and argv[0] in TOOLS:
        words = argv[1:]
        own = words[:words.index("--")] if "--" in words else words
        return Invocation(traceback="--traceback" in own)
    if argv and argv[0] in SUBCOMMANDS:
        return Invocation()
    launch = read_launch_argv(argv, launch_table())
    return Invocation(traceback=launch.traceback, launch=launch)


def _run_command(argv: list[str], invocation: Invocation) -> int:
    if os.environ.get(COMPLETE_VAR):
        return _complete(os.environ[COMPLETE_VAR])
    if argv and argv[0] in TOOLS:
        tool = tool_launch_argv(argv[0], argv[1:], launch_table())
        return ExitCode.OK if tool is None else _invoke(run_app, tool.click_args(), f"dtrun {argv[0]}", tool)
    if invocation.launch is None:
        return _invoke(sub_app, argv, "dtrun")
    if invocation.launch.error is not None:
        raise invocation.launch.error
    return _invoke(run_app, invocation.launch.click_args(), "dtrun", invocation.launch)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    invocation = Invocation()
    try:
        invocation = read_invocation(argv)
        code = _run_command(argv, invocation)
    except DtrunError as exc:
        if invocation.traceback:
            raise
        print(f"dtrun: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = ExitCode.INTERRUPTED
    except stopsignals.Stopped as exc:  # a stop signal where no job ran (launcher.job.stopsignals)
        print(f"dtrun: stopped by {signal_name(exc.signum)}", file=sys.stderr)
        code = stopsignals.exit_code(exc.signum)
    sys.exit(code)


if __name__ == "__main__":
    main()
