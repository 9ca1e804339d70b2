"""Launching through Slurm's own srun: which launcher, which ``--mpi`` plugin, the srun command.

Inside an allocation (``salloc``/``sbatch``) the ranks can be started by ``srun`` itself
instead of mpirun: no ssh, no MPI daemons, Slurm tracks and kills every rank. The MPI
library then talks to Slurm's process-management plugin, so the plugin must be one the
library speaks (checked with Slurm 22.05 on Debian 12):

* Open MPI 5 (PyPI wheel) and 4.1 (Debian): ``--mpi=pmix``. Under ``pmi2`` every rank
  starts as a singleton (size 1), Open MPI 5 says "no-pmix-but".
* MPICH (Debian, Hydra's PMI): ``--mpi=pmi2``. Under ``pmix`` every rank is a singleton.

``build_srun_groups`` is pure (spec → argument groups with reasons) so ``--dry-run``
shows it; ``mpi_plugins`` asks the installed srun (``srun --mpi=list``).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from dtrun.launcher import command as cmd
from dtrun.launcher.command import ArgGroup, LaunchSpec
from dtrun.launcher.errors import LaunchError, UsageError
from dtrun.launcher.flavors import Flavor

LAUNCHERS = ("auto", "srun", "mpirun")
MPI_LIST_TIMEOUT_S = 15
CHECK_TIMEOUT_S = 30.0
# Plugins each flavor speaks, best first. Sites may build only a versioned pmix plugin.
_PLUGINS_FOR = {
    "openmpi": ("pmix", "pmix_v5", "pmix_v4", "pmix_v3"),
    "mpich": ("pmi2",),
}
_PLUGIN_NAME = re.compile(r"^[a-z0-9_]+$")
_MCA_KEY = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass(frozen=True)
class Allocation:
    """The Slurm job this process runs in."""

    job_id: str
    cpus_per_task: Optional[int] = None


def current_allocation(environ: Mapping[str, str]) -> Optional[Allocation]:
    """The allocation this process runs in, or None.

    A shell that once ran inside an allocation can keep SLURM_JOB_NODELIST after the job
    ended; only SLURM_JOB_ID together with a node list counts as being inside one.
    """
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        return None
    if not job_id.isdigit() and not re.match(r"^\d+(_\d+)?$", job_id):
        raise UsageError(f"SLURM_JOB_ID={job_id!r} is not a Slurm job id")
    cpt = environ.get("SLURM_CPUS_PER_TASK")
    cpus = None
    if cpt:
        if not cpt.isdigit() or int(cpt) <= 0:
            raise UsageError(f"SLURM_CPUS_PER_TASK={cpt!r} is not a positive integer")
        cpus = int(cpt)
    return Allocation(job_id, cpus)


def parse_mpi_list(text: str) -> tuple[str, ...]:
    """Plugin names from ``srun --mpi=list`` (22.05: indented names, then
    "specific pmix plugin versions available: pmix_v4")."""
    names: list[str] = []
    for line in text.splitlines():
        if "versions available:" in line:
            names += [n.strip() for n in line.split(":", 1)[1].replace(",", " ").split()]
        elif line[:1].isspace() and line.strip():
            names.append(line.strip())
        elif line.startswith("srun: ") and line.count(" ") == 1:  # older: "srun: pmi2"
            names.append(line.split()[1])
    return tuple(dict.fromkeys(n for n in names if _PLUGIN_NAME.match(n)))


def find_srun(environ: Mapping[str, str]) -> Optional[str]:
    path = shutil.which("srun", path=environ.get("PATH"))
    return os.path.abspath(path) if path else None


def mpi_plugins(srun: str) -> tuple[str, ...]:
    """The ``--mpi`` plugins the installed Slurm offers (``srun --mpi=list``)."""
    try:
        out = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True,
                             timeout=MPI_LIST_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"'{srun} --mpi=list' did not answer within {MPI_LIST_TIMEOUT_S} s: "
                          "is slurmctld reachable? (scontrol ping)") from None
    except OSError as exc:
        raise LaunchError(f"cannot run {srun}: {exc.strerror}") from None
    return parse_mpi_list(out.stdout + out.stderr)


def plugin_for(flavor: Flavor, plugins: Sequence[str]) -> Optional[str]:
    """The ``--mpi`` plugin that ``flavor`` speaks among ``plugins``, or None."""
    for name in _PLUGINS_FOR["openmpi" if flavor.is_openmpi else "mpich"]:
        if name in plugins:
            return name
    return None


def needed_plugins(flavor: Flavor) -> str:
    return " or ".join(_PLUGINS_FOR["openmpi" if flavor.is_openmpi else "mpich"])


@dataclass(frozen=True)
class LauncherChoice:
    launcher: str  # "srun" or "mpirun"
    reason: str
    allocation: Optional[Allocation] = None
    plugins: tuple[str, ...] = ()
    srun: Optional[str] = None


def choose_launcher(requested: str, flavor: Flavor, from_slurm: bool,
                    environ: Mapping[str, str], plugins_of=mpi_plugins) -> LauncherChoice:
    """srun or mpirun, and why.

    ``auto`` takes srun inside an allocation whose nodes are the job's hosts, when srun
    offers the plugin this MPI speaks; mpirun otherwise. ``srun`` insists (and says
    exactly what is missing); ``mpirun`` keeps the mpirun path.

    Raises:
        UsageError: ``--launcher srun`` where it cannot work.
    """
    if requested not in LAUNCHERS:
        raise UsageError(f"--launcher {requested!r}: choose one of {', '.join(LAUNCHERS)}")
    alloc = current_allocation(environ)
    if requested == "mpirun":
        return LauncherChoice("mpirun", "--launcher mpirun", alloc)
    if alloc is None:
        if requested == "srun":
            raise UsageError("--launcher srun needs a Slurm allocation: run dtrun inside salloc or sbatch "
                             "(SLURM_JOB_ID is not set)")
        return LauncherChoice("mpirun", "not inside a Slurm allocation")
    if not from_slurm:
        if requested == "srun":
            raise UsageError("--launcher srun starts ranks on the allocation's nodes: drop -H/--hostfile/--cluster "
                             "(use --include/--exclude to pick nodes), or use --launcher mpirun")
        return LauncherChoice("mpirun", "hosts given on the command line, not the allocation's", alloc)
    srun = find_srun(environ)
    if srun is None:
        if requested == "srun":
            raise UsageError("--launcher srun: no srun on PATH")
        return LauncherChoice("mpirun", "no srun on PATH", alloc)
    plugins = plugins_of(srun)
    if plugin_for(flavor, plugins) is None:
        why = (f"{flavor.label} needs srun --mpi={needed_plugins(flavor)}; this Slurm offers "
               f"{', '.join(plugins) or 'none'}")
        if requested == "srun":
            raise UsageError(f"--launcher srun: {why}; use --launcher mpirun")
        return LauncherChoice("mpirun", why, alloc, plugins, srun)
    why = "--launcher srun" if requested == "srun" else "inside an allocation, and srun has the plugin this MPI needs"
    return LauncherChoice("srun", why, alloc, plugins, srun)


def nodes_for(spec: LaunchSpec) -> list[str]:
    """The first hosts whose slots hold ``spec.np`` ranks (all of them when oversubscribed)."""
    nodes, slots = [], 0
    for h in spec.hosts:
        if slots >= spec.np:
            break
        nodes.append(h.host)
        slots += h.slots
    return nodes


def openmpi_env(spec: LaunchSpec, flavor: Flavor) -> list[tuple[str, str, str]]:
    """What mpirun's --mca flags say, as OMPI_MCA_* variables (there is no mpirun under srun)."""
    out = []
    out += [(f"OMPI_MCA_{name}", value, why) for name, value, why in cmd.transports(spec, flavor)]
    osc = cmd.osc_setting(spec, flavor)
    if osc:
        out.append(("OMPI_MCA_osc", *osc))
    out += [(f"OMPI_MCA_{name}", value, why) for name, value, why in cmd.coll_settings(spec, flavor)]
    if not spec.local_only:
        if spec.include_iface:
            val = ",".join(spec.include_iface)
            out.append(("OMPI_MCA_btl_tcp_if_include", val, f"MPI traffic on {val} ({spec.iface_reason})"))
        else:
            val = ",".join(spec.exclude_iface)
            out.append(("OMPI_MCA_btl_tcp_if_exclude", val,
                        f"keep MPI traffic off {val}: docker0 carries the same address on every host and hangs the job"))
    for key, value in spec.mca:
        if not _MCA_KEY.match(key):  # it becomes part of a variable name
            raise UsageError(f"--mca {key!r}: an MCA parameter name is letters, digits and '_'")
        out.append((f"OMPI_MCA_{key}", value, "--mca from the command line"))
    return out


# Slurm's mpi/pmix runs a PMIx fence that carries no data (Open MPI's closing barrier of MPI_Init
# and MPI_Finalize) on its tree, and Slurm 22.05's reverse_tree_info() (Debian 12's slurm-wlm
# 22.05.8) gives every node of a step narrower than TreeWidth (default 50) neither parent nor
# children: each node ends the fence on its own, without the others. A rank on a node that got
# there first leaves MPI_Init and sends to a rank still in the modex fence, and that rank crashes
# in MPI_Init: Open MPI 4.1's btl/tcp calls the PML's receive callback before it is registered
# (a NULL call), Open MPI 5's ob1 match callback finds no communicator yet (SIGSEGV at 0xe0).
# Seen under load in tests/test_slurm.py::test_srun_launch_of_each_mpi. The ring fence, which
# Slurm already uses for fences that carry data, waits for every node.
PMIX_FENCE_VAR = "SLURM_PMIX_FENCE"
PMIX_FENCE_WHY = ("Slurm's ring fence for every PMIx fence: Slurm 22.05's tree fence does not wait for the other "
                  "nodes of a step under TreeWidth nodes, and a rank then crashes in MPI_Init (SIGSEGV) when a "
                  "faster node's first message reaches it early")


def pmix_fence_env(spec: LaunchSpec, flavor: Flavor, nodes: Sequence[str]) -> list[tuple[str, str, str]]:
    """SLURM_PMIX_FENCE=ring for Open MPI on more than one node, unless the user chose a fence
    (-x SLURM_PMIX_FENCE, or SLURM_PMIX_FENCE in dtrun's environment)."""
    if not flavor.is_openmpi or len(nodes) < 2:
        return []
    user = {cmd.parse_env_item(e)[0] for e in spec.env}
    if PMIX_FENCE_VAR in user or PMIX_FENCE_VAR in spec.env_names_set:
        return []
    return [(PMIX_FENCE_VAR, "ring", PMIX_FENCE_WHY)]


def srun_notes(spec: LaunchSpec, flavor: Flavor) -> list[str]:
    """Options the srun path cannot honour, each said once (dry run and launch)."""
    notes = []
    if spec.no_tree_spawn:
        notes.append("--no-tree-spawn has no effect under srun: there are no MPI daemons to spawn")
    if spec.ssh_config:
        notes.append("the ssh settings are not used: srun starts the ranks through slurmd, not ssh")
    if not flavor.is_openmpi and spec.include_iface and not spec.local_only:
        notes.append(f"MPICH under srun takes no interface option from dtrun; {','.join(spec.include_iface)} is "
                     "not passed (set MPICH's or libfabric's own variables with -x)")
    return notes


def build_srun_groups(spec: LaunchSpec, flavor: Flavor, plugins: Sequence[str],
                      cpus_per_task: Optional[int] = None, srun: str = "srun") -> list[ArgGroup]:
    """The srun command for ``spec`` as groups of arguments, each with its reason.

    Raises:
        UsageError: this Slurm offers no plugin the flavor speaks, or an option srun cannot take.
    """
    plugin = plugin_for(flavor, plugins)
    if plugin is None:
        raise UsageError(f"{flavor.label} needs srun --mpi={needed_plugins(flavor)}; this Slurm offers "
                         f"{', '.join(plugins) or 'none'}; use --launcher mpirun")
    values = [(n, v, why) for n, v, why in cmd._env_list(spec) if v is not None]
    nodes = nodes_for(spec)
    if flavor.is_openmpi:
        values = openmpi_env(spec, flavor) + pmix_fence_env(spec, flavor, nodes) + values
    g: list[ArgGroup] = []
    if values:
        # srun's --export splits on commas, so values (lo,docker0) go through srun's own
        # environment, which --export=ALL hands to every rank.
        for i, (name, value, why) in enumerate(values):
            g.append(ArgGroup((("env",) if i == 0 else ()) + (f"{name}={value}",), why))
    g.append(ArgGroup((srun, f"--ntasks={spec.np}"), f"{spec.np} ranks; srun by absolute path, inside the allocation"))
    g.append(ArgGroup((f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}"),
                      f"nodes of the {spec.host_source}, each filled to its slots in order (block distribution)"))
    g.append(ArgGroup((f"--mpi={plugin}",), f"{flavor.label} gets its process wiring from Slurm's {plugin} plugin"))
    g.append(ArgGroup(("--kill-on-bad-exit=1",), "a rank that fails ends the whole step, as under mpirun"))
    if cpus_per_task:
        g.append(ArgGroup((f"--cpus-per-task={cpus_per_task}",),
                          "SLURM_CPUS_PER_TASK of the allocation (srun 22.05+ no longer reads it by itself)"))
    if spec.oversubscribe:
        g.append(ArgGroup(("--overcommit",), "--oversubscribe: more ranks than CPUs allowed"))
    g.append(ArgGroup(("--export=ALL",),
                      "every rank gets this shell's environment (PATH, LD_LIBRARY_PATH, -x NAME)"))
    if spec.tag_output:
        g.append(ArgGroup(("--label",), "prefix each output line with its rank"))
    if spec.mpi_args:
        g.append(ArgGroup(tuple(spec.mpi_args), "--mpi-args, passed to srun unchanged"))
    g.append(cmd._program_group(spec))
    return g


def check_step(srun: str, nodes: Sequence[str], timeout: float = CHECK_TIMEOUT_S) -> None:
    """Start ``hostname`` once on every node through Slurm, instead of an ssh check.

    Raises:
        LaunchError: the step failed or did not finish within ``timeout``.
    """
    argv = [srun, f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=1", "--mpi=none", "hostname"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"Slurm could not run 'hostname' on {','.join(nodes)} within {timeout:g} s: the allocation's "
                          "CPUs may all be busy with another step, or a node does not answer; see "
                          "'scontrol show job $SLURM_JOB_ID', or skip this check with --no-preflight") from None
    except OSError as exc:
        raise LaunchError(f"cannot run {srun}: {exc.strerror}") from None
    if out.returncode != 0:
        detail = " ".join(out.stderr.split())[:300]
        raise LaunchError(f"Slurm could not run 'hostname' on {','.join(nodes)} (srun exited {out.returncode}: "
                          f"{detail}); see 'sinfo -N' and 'scontrol show job $SLURM_JOB_ID', "
                          "or skip this check with --no-preflight")


def srun_exit_code(result) -> int:
    """dtrun's exit code for a job srun ran: the first failing rank's.

    srun exits with the highest code of any task, which is 143 for the ranks it killed
    with SIGTERM after the first failure; mpirun reports the failing rank's own code.
    """
    if result.interrupted or not result.failures:
        return result.returncode
    first = result.failures[0]
    if first.signum is not None:
        return 128 + first.signum
    return first.code or result.returncode


def format_header(choice: LauncherChoice, flavor: Flavor, spec: LaunchSpec) -> str:
    hosts = len(spec.hosts)
    return (f"srun ({choice.reason}); {flavor.label}; {spec.np} ranks on {hosts} node{'s' if hosts != 1 else ''} "
            f"of Slurm job {choice.allocation.job_id if choice.allocation else '?'}")
