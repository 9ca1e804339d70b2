"""`dtrun stacks`: the roll-call report of a job that runs in another terminal."""
from __future__ import annotations

import sys
from typing import Optional

from dtrun.launcher.errors import ExitCode, UsageError
from dtrun.launcher.jobstate import find_job
from dtrun.launcher.stacks import report


def show_stacks(selector: Optional[str], timeout: float) -> int:
    """Find the running job, collect every rank's stack, print the report; 1 if a host did not answer."""
    if not timeout > 0:
        raise UsageError(f"--timeout {timeout:g}: give a number of seconds above 0")
    job = find_job(selector)
    hosts = len(set(job.hosts))
    text, _path, answers = report(job, f"stacks: job {job.id}, {job.np} ranks on {hosts} host"
                                       f"{'s' if hosts != 1 else ''} (dtrun pid {job.dtrun_pid}); the job goes on.",
                                  timeout)
    print(text)
    sys.stdout.flush()
    return ExitCode.FAILED if any(a.error for a in answers) else ExitCode.OK
