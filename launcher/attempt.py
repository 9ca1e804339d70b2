"""One attempt of a job: the prepared launch run under the job supervisor, with its watches.

``run_attempt`` takes plain data (the user's options and the ``AttemptSetup`` the run
settled) and hands back an immutable ``AttemptOutcome``: dtrun's exit code, the job's
result and record, the hosts. It writes the ssh files and the log directory, records the
job for `dtrun stacks` (launcher/jobstate.py), starts mpirun through
``launcher.job.supervisor.run_job`` with the hang watch and the straggler watch, and
leaves the end of the job to launcher/jobend.py. Whether another attempt follows is the
run's business (launcher/run.py), never this module's.
"""
from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from dtrun.launcher import jobend, jobstate
from dtrun.launcher.allocwatch import watch_allocation
from dtrun.launcher.dryrun import dry_run_text, launch_notes, verbose_text
from dtrun.launcher.errors import ExitCode, UsageError, signal_exit_code
from dtrun.launcher.hangwatch import HangWatch
from dtrun.launcher.hosts import HostSelection, is_local
from dtrun.launcher.job import stopsignals, supervisor
from dtrun.launcher.job.kill import pmix_namespace
from dtrun.launcher.job.observer import JobObserver
from dtrun.launcher.job.result import JobResult, expected_hosts
from dtrun.launcher.jobstate import JobInfo
from dtrun.launcher.launch import AttemptSetup, LaunchOptions, Preflight, PreparedLaunch, check_seconds, prepare, warn
from dtrun.launcher.remote import sessiondirs
from dtrun.launcher.sshmux import Masters, OpenOnceStarted
from dtrun.launcher.sshnames import SshNames
from dtrun.launcher.straggler import StragglerWatch
from dtrun.launcher.top import live_table


@dataclass(frozen=True)
class AttemptOutcome:
    """How one attempt ended: dtrun's exit code and what the run needs to decide what follows."""

    code: int  # dtrun's exit code for this attempt
    result: Optional[JobResult] = None  # None: a dry run
    job: Optional[JobInfo] = None  # the job's record (None without a job directory)
    nspace: str = ""  # Open MPI 5: the job's PMIx namespace, which proves its daemons to the kill agent
    selection: Optional[HostSelection] = None  # the attempt's hosts
    rank_hosts: tuple[str, ...] = ()  # host of each rank
    hosts: tuple[str, ...] = ()  # the hosts handed to the launcher
    srun: bool = False  # srun ran the job
    in_slurm: bool = False  # inside a Slurm allocation
    ended: bool = False  # Slurm ended the allocation or step (scancel): never restarted
    cleaned: bool = False  # the attempt already stopped its leftovers on every host
    ssh_names: Optional[SshNames] = None  # where each remote host's name leads over ssh (with run_attempt's masters)


def run_attempt(opts: LaunchOptions, setup: AttemptSetup = AttemptSetup(), preflight: Optional[Preflight] = None,
                observers: Sequence[JobObserver] = (), cleanup: bool = True,
                masters: Optional[Masters] = None) -> AttemptOutcome:
    """Run (or with --dry-run, print) one attempt of the job (``preflight``: see ``launch.prepare``).

    ``cleanup=False`` leaves the clean-up after a failure to the run, which first checks the
    hosts (a signal still cleans up here). ``masters``: the run's ssh master connections
    (launcher/sshmux.py), opened to this attempt's remote hosts once the job runs
    (sshmux.OpenOnceStarted); with them, where the hosts' names lead over ssh is found while
    the job runs (launcher/sshnames.py), for the run's recovery."""
    prepared = prepare(opts, preflight=preflight, setup=setup)
    if opts.dry_run:
        print(dry_run_text(opts, prepared))
        return AttemptOutcome(ExitCode.OK)
    _before_start(opts, prepared)
    sweep = _sweeps_session_dirs(prepared)
    job, watches = _watches(opts, prepared, setup.job_dir, sweep, cleanup)
    spec, launcher_choice = prepared.spec, prepared.launcher_choice
    remote = [h.host for h in spec.hosts if not is_local(h.host)]
    over_ssh = bool(remote) and launcher_choice.launcher != "srun"
    names = None
    if masters is not None and over_ssh:
        names = SshNames(spec.ssh_config, remote)
        watches += (OpenOnceStarted(masters, remote, spec.ssh_config, spec.np),)
    expected = expected_hosts(spec.hosts, spec.np) if spec.rank_wrapper else []
    allocation = launcher_choice.allocation
    stop_watch = watch_allocation(allocation.job_id, environ=os.environ) if allocation else None
    # A stop signal from mpirun's start to the end of the clean-up is the supervisor's, or
    # waits for the clean-up to finish (launcher.job.stopsignals): nothing is left running.
    with stopsignals.held():
        try:
            result = supervisor.run_job([a for g in prepared.groups for a in g.args], timeout=_time_left(opts, setup),
                                        timeout_limit=check_seconds(opts.timeout, "--timeout"),
                                        start_timeout=check_seconds(opts.start_timeout, "--start-timeout"),
                                        expected=expected, observers=tuple(observers) + watches)
        finally:
            if stop_watch is not None:
                stop_watch()
        cleaned = cleanup or result.interrupted
        nspace = pmix_namespace(result.launcher_pid) if job is not None else ""
        result = jobend.clean_up(prepared, result, job, nspace, cleaned, sweep)
        ended = jobend.ended_by_slurm(prepared, result)
        # An end an observer planned (ranks leaving at a commit for new hosts, launcher/elastic.py) is no failure to report.
        if not ended and not any(getattr(o, "planned_end", None) and o.planned_end(result) for o in observers):
            result = jobend.report(prepared, result, opts.on_hang)
    return AttemptOutcome(signal_exit_code(signal.SIGTERM) if ended else result.returncode, result, job, nspace,
                          prepared.selection, tuple(expected_hosts(spec.hosts, spec.np)),
                          tuple(h.host for h in spec.hosts), srun=launcher_choice.launcher == "srun",
                          in_slurm=allocation is not None, ended=ended, cleaned=cleaned, ssh_names=names)


def _time_left(opts: LaunchOptions, setup: AttemptSetup) -> Optional[float]:
    """Seconds this attempt may run: what is left of the run's --timeout (restarts share it)."""
    limit = check_seconds(opts.timeout, "--timeout")
    if limit is None or setup.deadline is None:
        return limit
    return max(setup.deadline - time.monotonic(), 0.0)


def _before_start(opts: LaunchOptions, prepared: PreparedLaunch) -> None:
    """--verbose's account, the ssh files, the MPI's warnings and the log directory."""
    notes = launch_notes(prepared)
    if opts.verbose:
        print(verbose_text(opts, prepared, notes), file=sys.stderr, flush=True)
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
    sweep = flavor.is_openmpi and flavor.major >= 5 and prepared.launcher_choice.launcher != "srun"
    if sweep:
        sessiondirs.sweep()
    return sweep


def _watches(opts: LaunchOptions, prepared: PreparedLaunch, job_dir: Optional[str],
             sweep: bool, cleanup: bool = True) -> tuple[Optional[JobInfo], tuple[JobObserver, ...]]:
    """(the job's record or None, what watches the job beside the supervisor): the session
    lock, and with a job directory the straggler watch and the hang watch (``cleanup``: as
    run_attempt's; False, the run stops what a failed job leaves, and the hang watch need not)."""
    # mpirun's own directory is locked while it runs: only then may a sweep from any pid
    # namespace that shares this temporary directory tell it from a killed job's.
    watches: tuple[JobObserver, ...] = (sessiondirs.LauncherLock(),) if sweep else ()
    if job_dir is None:
        return None, watches
    spec = prepared.spec
    job = jobstate.write(job_dir, [h.host for h in prepared.selection.hosts], spec.np, spec.ssh_config, spec.log_dir,
                         prepared.flavor.label, spec.program)
    # Reaping a job's stuck daemons after its end goes over ssh; inside a Slurm allocation
    # the daemons ran as a Slurm step, which Slurm ends itself (and ssh may be blocked there).
    hang = HangWatch(job, opts.hang_timeout, opts.on_hang, reap_daemons=sweep and prepared.launcher_choice.allocation is None,
                     cleanup_follows=not cleanup)
    # the straggler finding at the end; the hang watch last, as its end may wait on ssh
    return job, watches + (StragglerWatch(job, table=live_table if opts.top else None), hang)


def start_log_dir(log_dir: str) -> None:
    """Create this run's log directory, new and private (mode 0700), and point DIR/latest at it.

    A directory of that name that exists already (another run's, or one planted in a shared
    DIR) is refused, never written into. DIR/latest is replaced by a rename, never followed,
    and is skipped where it cannot be made (a file system without symlinks, a directory
    of that name): the run's own directory is what counts.
    """
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
