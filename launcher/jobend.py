"""The end of one attempt, after the launcher has exited: what dtrun does with the job's result.

It stops what a stopped job left on the hosts (launcher/job/kill.py), sweeps this host's
Open MPI 5 session directories, gives srun's exit code, tells a job Slurm ended from one
that failed, and prints the failure summary with its notes. Each step that has more to say
makes a new ``JobResult`` (the supervisor's is never changed). Separate from the attempt
(launcher/attempt.py), which starts the job and its watches.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Optional

from dtrun.launcher import command as cmd
from dtrun.launcher import slurm
from dtrun.launcher.allocwatch import ended_message, ended_state
from dtrun.launcher.flavors import Flavor
from dtrun.launcher.job.kill import kill_leftovers
from dtrun.launcher.job.result import JobResult
from dtrun.launcher.job.summary import failure_summary, pmix_refused_note, tree_spawn_note
from dtrun.launcher.jobstate import JobInfo
from dtrun.launcher.launch import PreparedLaunch
from dtrun.launcher.remote import sessiondirs

# Seconds the kill agents get to stop what a stopped job left on its hosts. A signal leaves
# little time (dtrun exits within about 5 s of SIGTERM); a time limit or --on-hang abort more.
KILL_BUDGET_S, KILL_BUDGET_SIGNAL_S = 5.0, 1.5


def clean_up(prepared: PreparedLaunch, result: JobResult, job: Optional[JobInfo], nspace: str, kill: bool,
             sweep: bool) -> JobResult:
    """Stop what a stopped job left on the hosts (with ``kill``), sweep session directories;
    the result with the sweep's note and, under srun, srun's exit code.

    ``nspace``: the job's Open MPI 5 PMIx namespace, which proves its daemons to the kill agent."""
    srun = prepared.launcher_choice.launcher == "srun"
    if kill and job is not None and (result.hung or (result.stopped and not srun)):
        # Nothing of a job dtrun stopped may stay behind on any host: an MPI daemon can outlive
        # an mpirun that had to be killed (Open MPI 5's prted on a loaded machine does).
        # Under srun, Slurm ends the step's processes itself (and ssh may be blocked there).
        kill_leftovers(job, job.hosts, nspace, KILL_BUDGET_SIGNAL_S if result.interrupted else KILL_BUDGET_S)
    if sweep:
        removed = sessiondirs.sweep()
        if result.pmix_refused:
            result = replace(result, notes=result.notes + (pmix_refused_note(result.pmix_refused, len(removed)),))
    if srun:
        result = replace(result, returncode=slurm.srun_exit_code(result))
    return result


def ended_by_slurm(prepared: PreparedLaunch, result: JobResult) -> bool:
    """Whether Slurm ended the allocation under the job; if so, say so."""
    allocation = prepared.launcher_choice.allocation
    ended = ended_state(allocation.job_id) if allocation and not result.interrupted else None
    if not ended:
        return False
    # Slurm stopped the ranks: that, not the first rank it killed, is the cause, and the code
    # is SIGTERM's, as Slurm stops jobs (the attempt's). What mpirun itself returns then is
    # happenstance: 0 (Open MPI 5, when scancel killed its daemons' step), 1 (it lost a daemon
    # first) or 143.
    print(ended_message(allocation.job_id, ended, "the job was stopped"), file=sys.stderr)
    return True


def report(prepared: PreparedLaunch, result: JobResult, on_hang: str) -> JobResult:
    """Print the failure summary of a failed job (or its notes); the result with every note."""
    hosts = len(prepared.selection.hosts)
    if tree_spawn_failure(result, prepared.spec, prepared.flavor, hosts, prepared.launcher_choice.launcher):
        result = replace(result, notes=result.notes + (tree_spawn_note(hosts),))
    if result.returncode != 0 or result.notes:
        print(failure_summary(result, prepared.spec.log_dir, on_hang), file=sys.stderr)
    return result


def tree_spawn_failure(result: JobResult, spec: cmd.LaunchSpec, flavor: Flavor, hosts: int, launcher: str) -> bool:
    """Whether mpirun failed silently, before any rank, on a launch that used Open MPI's tree spawn."""
    return (result.unexplained and launcher != "srun" and flavor.is_openmpi and not spec.no_tree_spawn
            and hosts > cmd.tree_radix(os.environ))
