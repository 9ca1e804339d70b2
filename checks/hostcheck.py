"""The quick check of a job's hosts after it failed: which of them are gone.

dtrun runs it when a multi-host job fails, to name a lost host in one line, and with
``--max-restarts`` to leave such hosts out of the next attempt (launcher/restarts.py,
which gets it injected by the CLI: launcher/ never imports checks/). Every host is
checked at once and each step is bounded by a timeout, so a dead host costs the
timeout, not more:

* under mpirun: the preflight's cheap check, a TCP connection to the host's sshd that
  must answer with its SSH banner (``checks.preflight.reachable``);
* inside a Slurm allocation whose nodes are the job's hosts: a one-task step
  (``srun --overlap -w NODE hostname``) on each node, because sites often block ssh to
  compute nodes; ``--overlap`` keeps it from waiting for the failed step's CPUs.

``quick=True`` is the restart loop's check when its next attempt can go on without a host
that does not answer (a spare, or ``--min-np``): the ssh check is then bounded by
``QUICK_TIMEOUT_S`` instead of ``TIMEOUT_S``. A Slurm step keeps its own bound: its start
goes through slurmctld, whose answer takes seconds on a healthy cluster.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Mapping, Optional, Sequence

from dtrun.checks.preflight import reachable
from dtrun.launcher.hosts import SLURM_SOURCE, is_local
from dtrun.launcher.safe import plain_text

TIMEOUT_S = 5.0
# A healthy host's sshd sends its banner within milliseconds of the connection. Two seconds
# leave room for one lost SYN (Linux resends the first after 1 s) and for a host busy with a
# failed job's tear-down, and still spare the restart most of TIMEOUT_S.
QUICK_TIMEOUT_S = 2.0
SLURM_TIMEOUT_S = 10.0  # a step's start goes through slurmctld and the node's slurmd


def short_reason(detail: str) -> str:
    """The first clause of a check's finding ("TCP to h2 (10.0.0.2:22) timed out after 5 s")."""
    return detail.split(": ", 1)[0].strip()


def check_hosts(opts, selection, hosts: Sequence, environ: Optional[Mapping[str, str]] = None,
                timeout: Optional[float] = None, quick: bool = False) -> dict[str, str]:
    """Check ``hosts`` (``HostSlots``) of a failed job; return {host: why it failed} for those that did.

    ``quick``: over ssh, wait ``QUICK_TIMEOUT_S`` for each host instead of ``TIMEOUT_S``."""
    from dtrun.checks.sshtarget import ssh_config_path  # lazy: failed jobs only; every launch imports this module
    from dtrun.launcher.slurm import current_allocation, find_srun  # lazy: failed jobs only; every launch imports this module

    environ = os.environ if environ is None else environ
    if selection is not None and selection.source == SLURM_SOURCE and current_allocation(environ) is not None:
        return slurm_nodes(find_srun(environ) or "srun", [h.host for h in hosts],
                           SLURM_TIMEOUT_S if timeout is None else timeout)
    cfg = ssh_config_path(opts.hosts.ssh_config, selection.ssh_config if selection else None, environ)
    remote = [h for h in hosts if not is_local(h.host)]
    if timeout is None:
        timeout = QUICK_TIMEOUT_S if quick else TIMEOUT_S
    found = reachable(remote, cfg, timeout)
    return {f.host: f"ssh: {short_reason(f.detail)}" for f in found}


def slurm_nodes(srun: str, nodes: Sequence[str], timeout: float) -> dict[str, str]:
    """A one-task step on every node at once; {node: why} for each one where it did not run."""
    procs = {}
    bad: dict[str, str] = {}
    for node in nodes:
        plain_text(node, "Slurm node name")
        argv = [srun, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--mpi=none",
                "--time=1", "hostname"]
        try:
            procs[node] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            bad[node] = f"cannot run {srun}: {exc.strerror}"
    deadline = time.monotonic() + timeout
    for node, p in procs.items():
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(p)
            bad[node] = f"Slurm could not start a step on {node} within {timeout:g} s"
            continue
        if p.returncode != 0:
            detail = " ".join((err or "").split())[:200]
            bad[node] = f"Slurm could not start a step on {node} (srun exited {p.returncode}: {detail})"
    return bad


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=2)
    except subprocess.TimeoutExpired:
        pass
