"""The dtrun command line: parse, build one options object, hand it on. Nothing else.

``dtrun [OPTIONS] PROGRAM [ARGS...]`` launches; ``dtrun hosts|smoke|bench|doctor|keyscan``
are subcommands. Only typer and the standard library are imported here; the commands
import what they need (rich, paramiko, mpi4py) when they run.
"""
from __future__ import annotations

import sys
from typing import List, Optional

import typer

from launcher.errors import DtrunError, ExitCode, UsageError

SUBCOMMANDS = ("hosts", "smoke", "bench", "doctor", "keyscan")
_state = {"traceback": False}

run_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
sub_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                      no_args_is_help=True)

_H = typer.Option(None, "-H", "--host", help="Hosts and slots: server1:4,server2:4 (a bare host is 1 slot).")
_HOSTFILE = typer.Option(None, "--hostfile", "-f", help="Open MPI ('host slots=N') or MPICH ('host:N') hostfile.")
_CLUSTER = typer.Option(None, "--cluster", help="YAML cluster file (per-host slots, user, port, identity_file).")
_INCLUDE = typer.Option([], "--include", help="Only these hosts (comma-separated, repeatable).")
_EXCLUDE = typer.Option([], "--exclude", help="Leave out these hosts (comma-separated, repeatable).")
_SSH_CONFIG = typer.Option(None, "--ssh-config", help="ssh config file for reaching the hosts (also $DTRUN_SSH_CONFIG).")


@run_app.command(
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True,
                      "help_option_names": ["-h", "--help"]},
    epilog="Subcommands: dtrun hosts | smoke | bench | doctor | keyscan (each with --help).",
)
def run(
    program: List[str] = typer.Argument(None, help="The program and its arguments (never parsed by dtrun).",
                                        metavar="PROGRAM [ARGS]..."),
    np: Optional[int] = typer.Option(None, "-np", "-n", "--np", help="Number of ranks (default: total slots)."),
    host_list: Optional[str] = _H,
    hostfile: Optional[str] = _HOSTFILE,
    cluster: Optional[str] = _CLUSTER,
    include: List[str] = _INCLUDE,
    exclude: List[str] = _EXCLUDE,
    oversubscribe: bool = typer.Option(False, "--oversubscribe", help="Allow more ranks than slots."),
    include_iface: Optional[str] = typer.Option(None, "--include-iface", help="Use only this interface or CIDR subnet for MPI/NCCL TCP."),
    exclude_iface: Optional[str] = typer.Option(None, "--exclude-iface", help="Avoid these interfaces (default lo,docker0)."),
    env: List[str] = typer.Option([], "-x", help="Forward NAME, or set NAME=VALUE, on every rank (repeatable)."),
    mca: List[str] = typer.Option([], "--mca", help="Open MPI MCA parameter: --mca KEY VALUE (repeatable).", metavar="KEY VALUE"),
    mpi_args: Optional[str] = typer.Option(None, "--mpi-args", help="Extra mpirun arguments, passed unchanged."),
    tag_output: Optional[bool] = typer.Option(None, "--tag-output/--no-tag-output", help="Prefix output lines with the rank (default: on for multi-host)."),
    log_dir: Optional[str] = typer.Option(None, "--log-dir", help="Write each rank's output to DIR/rank.N.log."),
    nccl_debug: Optional[str] = typer.Option(None, "--nccl-debug", help="Set NCCL_DEBUG=LEVEL on every rank (e.g. INFO, WARN)."),
    no_tree_spawn: bool = typer.Option(False, "--no-tree-spawn", help="Start all remote daemons from this host (Open MPI)."),
    mpirun: Optional[str] = typer.Option(None, "--mpirun", help="The mpirun/mpiexec to use (default: the one in this environment, then PATH)."),
    ssh_config: Optional[str] = _SSH_CONFIG,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the mpirun command with the reason for each flag; run nothing."),
    no_preflight: bool = typer.Option(False, "--no-preflight", help="Skip the check of ssh and interfaces before a multi-host launch."),
    traceback: bool = typer.Option(False, "--traceback", help="Show the Python traceback of an error."),
):
    """Launch PROGRAM on the hosts with mpirun, with the flags experienced users add by hand."""
    _state["traceback"] = traceback
    from launcher.launch import LaunchOptions, launch

    opts = LaunchOptions(
        program=tuple(program or ()), np=np, host_list=host_list, hostfile=hostfile, cluster=cluster,
        include=tuple(include), exclude=tuple(exclude), oversubscribe=oversubscribe,
        include_iface=include_iface, exclude_iface=exclude_iface, env=tuple(env), mca=tuple(tuple(m.split("=", 1)) for m in mca),
        mpi_args=mpi_args, tag_output=tag_output, log_dir=log_dir, nccl_debug=nccl_debug,
        no_tree_spawn=no_tree_spawn, mpirun=mpirun, ssh_config=ssh_config, dry_run=dry_run,
        preflight=not no_preflight,
    )
    raise typer.Exit(launch(opts))


@sub_app.command("hosts")
def hosts_cmd(
    host_list: Optional[str] = _H,
    hostfile: Optional[str] = _HOSTFILE,
    cluster: Optional[str] = _CLUSTER,
    include: List[str] = _INCLUDE,
    exclude: List[str] = _EXCLUDE,
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Print the resolved hosts and slots."""
    from launcher.hostsview import HostsQuery, show_hosts

    raise typer.Exit(show_hosts(HostsQuery(host_list, hostfile, cluster, tuple(include), tuple(exclude), json_out)))


_TIMEOUT = typer.Option(5.0, "--timeout", help="Seconds each network step (connect, handshake, probe) may take.")


@sub_app.command("doctor")
def doctor_cmd(
    host_list: Optional[str] = _H,
    hostfile: Optional[str] = _HOSTFILE,
    cluster: Optional[str] = _CLUSTER,
    include: List[str] = _INCLUDE,
    exclude: List[str] = _EXCLUDE,
    ssh_config: Optional[str] = _SSH_CONFIG,
    timeout: float = _TIMEOUT,
    json_out: bool = typer.Option(False, "--json", help="Print the findings as JSON (for CI)."),
    all_pairs: bool = typer.Option(False, "--all-pairs", help="Also check ssh from every host to every other."),
    program: Optional[str] = typer.Option(None, "--program", help="A script that must exist at the same path on every host."),
    no_e2e: bool = typer.Option(False, "--no-e2e", help="Skip the end-to-end job."),
    e2e_timeout: Optional[float] = typer.Option(None, "--e2e-timeout", help="Seconds the end-to-end job may take before it counts as a hang (default 40)."),
):
    """Check ssh, environment, network, firewall and GPUs on every host; say what to fix."""
    from checks.doctor import DoctorSpec, run_doctor

    raise typer.Exit(run_doctor(DoctorSpec(
        host_list, hostfile, cluster, tuple(include), tuple(exclude), ssh_config, timeout, json_out, all_pairs,
        program, not no_e2e, e2e_timeout)))


@sub_app.command("keyscan")
def keyscan_cmd(
    hosts: List[str] = typer.Argument(None, help="Host names (comma-separated or several)."),
    host_list: Optional[str] = _H,
    hostfile: Optional[str] = _HOSTFILE,
    cluster: Optional[str] = _CLUSTER,
    ssh_config: Optional[str] = _SSH_CONFIG,
    timeout: float = _TIMEOUT,
    yes: bool = typer.Option(False, "--yes", "-y", help="Add unknown keys without asking (for scripts)."),
):
    """Show each host's SSH key fingerprint and add unknown keys to known_hosts after confirmation."""
    from checks.keyscan import KeyscanSpec, keyscan

    raise typer.Exit(keyscan(KeyscanSpec(tuple(hosts or ()), host_list, hostfile, cluster, ssh_config, timeout, yes)))


def _tool_argv(module: str, argv: list[str]) -> list[str]:
    """``dtrun smoke|bench OPTS -- TOOLARGS`` → ``dtrun OPTS -- python -m MODULE TOOLARGS``.

    smoke and bench are the launch command with a fixed program, so they take its options.
    """
    if "--" in argv:
        i = argv.index("--")
        opts, tool = argv[:i], argv[i + 1:]
    else:
        opts, tool = argv, []
    if any(a in ("-h", "--help") for a in opts):
        return ["--help"]
    return opts + ["--", sys.executable, "-m", module] + tool


# Options of the launch command that take a value: needed to find where PROGRAM starts.
_VALUE_OPTIONS = {"-np", "-n", "--np", "-H", "--host", "--hostfile", "-f", "--cluster", "--include",
                  "--exclude", "--include-iface", "--exclude-iface", "-x", "--mpi-args", "--log-dir",
                  "--nccl-debug", "--mpirun", "--ssh-config"}


def fold_mca(argv: list[str]) -> list[str]:
    """Turn ``--mca KEY VALUE`` (mpirun's spelling) into ``--mca KEY=VALUE`` before PROGRAM."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--" or not a.startswith("-"):
            return out + argv[i:]
        if a == "--mca":
            if i + 2 >= len(argv) or not argv[i + 1] or "=" in argv[i + 1]:
                raise UsageError("--mca needs two values: --mca KEY VALUE")
            out += ["--mca", f"{argv[i + 1]}={argv[i + 2]}"]
            i += 3
            continue
        out.append(a)
        if a in _VALUE_OPTIONS:
            out += argv[i + 1:i + 2]
            i += 1
        i += 1
    return out


def _invoke(app: typer.Typer, argv: list[str], prog: str) -> int:
    from typer._click import exceptions as click_exc

    try:
        rv = app(args=argv, prog_name=prog, standalone_mode=False)
        return int(rv or 0)
    except typer.Exit as e:
        return int(e.exit_code)
    except click_exc.ClickException as e:  # usage errors: one line, exit 2
        print(f"dtrun: error: {e.format_message()}", file=sys.stderr)
        return ExitCode.USAGE if e.exit_code == 2 else int(e.exit_code)
    except typer.Abort:
        return ExitCode.INTERRUPTED


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in ("smoke", "bench"):
            module = "collectives.smoke" if argv[0] == "smoke" else "collectives.bench"
            code = _invoke(run_app, fold_mca(_tool_argv(module, argv[1:])), f"dtrun {argv[0]}")
        elif argv and argv[0] in SUBCOMMANDS:
            code = _invoke(sub_app, argv, "dtrun")
        else:
            code = _invoke(run_app, fold_mca(argv), "dtrun")
    except DtrunError as exc:
        if _state["traceback"]:
            raise
        print(f"dtrun: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = ExitCode.INTERRUPTED
    sys.exit(code)


if __name__ == "__main__":
    main()
