"""What ``--dry-run`` prints, and ``--verbose`` before a launch: the command with the reason
for each flag, this MPI's (or srun's) warnings, and the ssh files a launch would write.

Apart from ``launcher/launch.py`` because it renders a settled launch (``PreparedLaunch``)
and decides nothing: the attempt (launcher/attempt.py) prints it, and so does a dry run.
"""
from __future__ import annotations

from typing import Optional

from dtrun.launcher import command as cmd
from dtrun.launcher import slurm
from dtrun.launcher.flavors import Flavor
from dtrun.launcher.launch import LaunchOptions, PreparedLaunch


def describe(opts: LaunchOptions, selection, flavor: Flavor, spec: cmd.LaunchSpec, groups, notes=(),
             launcher_choice: Optional[slurm.LauncherChoice] = None) -> str:
    """The --dry-run / --verbose text: what runs, each flag with its reason."""
    hosts = len(selection.hosts)
    if launcher_choice is not None and launcher_choice.launcher == "srun":
        return cmd.format_dry_run(groups, slurm.format_header(launcher_choice, flavor, spec),
                                  slurm.srun_notes(spec, flavor))
    header = (f"{flavor.label} ({flavor.mpirun}); {spec.np} ranks on {hosts} host{'s' if hosts != 1 else ''} "
              f"from {selection.source}")
    if launcher_choice is not None and launcher_choice.allocation is not None:
        header += f"; mpirun, not srun: {launcher_choice.reason}"
    if spec.local_only:
        header += "; every host is this machine, so no interface flags"
    elif not opts.preflight:
        header += "; --no-preflight: interfaces not checked on the hosts"
    if spec.log_dir:
        header += f"; rank logs in {spec.log_dir}"
    return cmd.format_dry_run(groups, header, notes)


def launch_notes(prepared: PreparedLaunch) -> list[str]:
    """The warnings of this MPI (or srun) for this spec, shown before the job and in --dry-run."""
    if prepared.launcher_choice.launcher == "srun":
        return slurm.srun_notes(prepared.spec, prepared.flavor)
    return cmd.flavor_notes(prepared.spec, prepared.flavor)


def dry_run_text(opts: LaunchOptions, prepared: PreparedLaunch) -> str:
    """What --dry-run prints: the command with its reasons, then the ssh files a launch would write."""
    lines = [describe(opts, prepared.selection, prepared.flavor, prepared.spec, prepared.groups,
                      launch_notes(prepared), prepared.launcher_choice)]
    for f in prepared.spec.ssh_files:
        lines.append(f"# a launch first writes {f.path} (--dry-run wrote nothing):")
        lines.append("\n".join(f"#   {line}" for line in f.text.splitlines()))
    return "\n".join(lines)


def verbose_text(opts: LaunchOptions, prepared: PreparedLaunch, notes) -> str:
    """What --verbose prints on stderr before a launch: the --dry-run account, each line marked."""
    text = describe(opts, prepared.selection, prepared.flavor, prepared.spec, prepared.groups, notes,
                    prepared.launcher_choice)
    return "\n".join(f"dtrun: {line}" for line in text.splitlines())
