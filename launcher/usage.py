"""The launch command's usage checks: everything about its options that needs no network.

``check_usage`` runs once per launch, before the preflight touches a host, so a usage
error (``-np 0``, a bad ``-x`` or ``--mca``, conflicting interface flags, no program) is
reported as such (exit 2) even when a host cannot be reached. It returns a ``Usage`` with
the values it had to work out to check them (the rank count, ``--mpi-args``, the interface
lists, the job's ssh files), and the launch builds its spec from those, so no option's
text is read twice.
It is apart from ``launch.py`` because each check has one home here, whichever step of
the launch needs its value.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Mapping, Optional

from dtrun.launcher import command as cmd
from dtrun.launcher import safe
from dtrun.launcher.errors import UsageError
from dtrun.launcher.flavors import Flavor
from dtrun.launcher.hosts import HostSelection, resolve_np
from dtrun.launcher.sshconf import SshFiles, base_ssh_config, job_ssh_files


@dataclass(frozen=True)
class Usage:
    """The checked command line's parsed values (what ``check_usage`` read to check them)."""

    np: int  # the number of ranks (-np, else the hosts' slots)
    env: tuple[tuple[str, Optional[str]], ...] = ()  # -x items as (NAME, VALUE), VALUE None to forward NAME
    mpi_args: tuple[str, ...] = ()  # --mpi-args, split as a shell would
    include_iface: tuple[str, ...] = ()  # --include-iface, split at commas and checked
    exclude_iface: tuple[str, ...] = ()  # --exclude-iface, split at commas and checked
    ssh_files: SshFiles = SshFiles()  # the ssh config (and Hydra's wrapper) the job needs, not yet written


def check_usage(opts, flavor: Flavor, selection: HostSelection, environ: Mapping[str, str]) -> Usage:
    """Check every option of ``opts`` (``launch.LaunchOptions``) that needs no network.

    Raises:
        UsageError: the first problem found, naming its argument.
    """
    if not opts.program:
        raise UsageError("no program given: dtrun [OPTIONS] PROGRAM [ARGS...]")
    np = resolve_np(opts.np, selection, opts.oversubscribe)
    env = tuple(cmd.parse_env_item(item) for item in opts.env)
    for item in opts.mca:
        if len(item) != 2:
            raise UsageError("--mca needs two values: --mca KEY VALUE")
        safe.mca_value(safe.mca_key(item[0]), item[1])
    if opts.mca and not flavor.is_openmpi:
        raise UsageError("--mca is an Open MPI option; this mpirun is MPICH (Hydra)")
    mpi_args = split_mpi_args(opts.mpi_args)
    if opts.horovod and environ.get("PYTHONPATH") and not any(
            item.startswith("PYTHONPATH=") for item in opts.env):  # goes on mpirun's command line
        safe.plain_text(environ["PYTHONPATH"], "--horovod: this shell's PYTHONPATH")
    for flag, value in (("--log-dir", opts.log_dir), ("--nccl-debug", opts.nccl_debug)):
        if value is not None:
            safe.plain_text(value, flag)
    if opts.include_iface and opts.exclude_iface:
        raise UsageError("--include-iface and --exclude-iface cannot be used together (Open MPI rejects both at once)")
    include = split_ifaces(opts.include_iface, "--include-iface") if opts.include_iface else ()
    exclude = split_ifaces(opts.exclude_iface, "--exclude-iface") if opts.exclude_iface else ()
    ssh_files = job_ssh_files(selection, base_ssh_config(opts.hosts.ssh_config, selection.ssh_config, environ),
                              flavor.is_openmpi)  # checks that every host's settings can be written there
    return Usage(np, env, mpi_args, include, exclude, ssh_files)


def split_ifaces(value: str, flag: str) -> tuple[str, ...]:
    """A comma-separated list of interface names or CIDR subnets, each checked (``flag`` names its source)."""
    items = tuple(i.strip() for i in value.split(",") if i.strip())
    if not items:
        raise UsageError(f"{flag}: empty interface list")
    return tuple(safe.iface(i, flag) for i in items)


def split_mpi_args(text: Optional[str]) -> tuple[str, ...]:
    """--mpi-args split as a shell would, each argument checked as plain text."""
    if not text:
        return ()
    try:
        args = tuple(shlex.split(text))
    except ValueError as exc:
        raise UsageError(f"--mpi-args {text!r}: {exc} (quote it as a shell would)") from None
    for a in args:
        safe.plain_text(a, "--mpi-args: argument")
    return args
