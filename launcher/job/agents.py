"""The command line that runs the host agent (launcher/remote/agent.py) on one of a job's hosts.

Every caller that asks the hosts something uses it: the hang report and ``dtrun stacks``
(mode ``dump``), the hang watch (``watch``), the straggler watch (``sample``) and the stop
path (``kill``, ``reap``, ``tidy``: launcher/job/kill.py).
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional, Sequence

from dtrun.launcher import sshmux
from dtrun.launcher.hosts import is_local
from dtrun.launcher.jobstate import JobInfo

AGENT = str(Path(__file__).resolve().parent.parent / "remote" / "agent.py")


def agent_argv(job: JobInfo, host: str, mode: str, seconds: float, extra: Sequence[str] = (),
               connect_timeout: Optional[float] = None) -> list[str]:
    """The command that runs the agent on ``host``: directly when local, else through ssh
    (connecting within ``connect_timeout`` seconds, by default ``seconds``; through the run's
    master connection to the host when it has one, launcher/sshmux.py)."""
    remote = [job.python, "-S", AGENT, mode, job.dir, f"{seconds:g}", *extra]
    if is_local(host):
        return remote
    connect = seconds if connect_timeout is None else connect_timeout
    ssh = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(connect))}", *sshmux.control_args(host)]
    if job.ssh_config:
        ssh += ["-F", job.ssh_config]
    return ssh + [host, shlex.join(remote)]
