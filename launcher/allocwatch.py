"""dtrun never outlives the Slurm allocation it runs in.

What a command run by ``salloc`` receives when the allocation ends (observed with Slurm
22.05): nothing on ``scancel``, nothing at the time limit, nothing when salloc gets
SIGINT or SIGTERM (salloc revokes the allocation and keeps waiting for its command),
nothing when salloc is killed with SIGKILL (the allocation stays until it ends some other
way). Only a SIGHUP to salloc is passed on. A batch script (``sbatch``) gets SIGTERM
from slurmstepd, which dtrun already handles.

So dtrun asks slurmctld on a slow timer (``squeue -j ID``); once the job is gone or
ending, it says so and stops the job the way SIGTERM does.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Callable, Mapping, Optional

POLL_S = 10.0  # DTRUN_SLURM_POLL_S overrides; one squeue per interval
SQUEUE_TIMEOUT_S = 10.0
# Job states in which the allocation still holds its nodes for us.
ALIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "RESIZING", "REQUEUED", "STOPPED",
                   "SIGNALING", "STAGE_OUT"})
GONE = "GONE"  # squeue no longer knows the job


def parse_squeue(returncode: int, stdout: str, stderr: str) -> Optional[str]:
    """The job's state from ``squeue -h -j ID -o %T``: a state name, GONE, or None (no answer)."""
    state = stdout.strip().split("\n")[0].strip() if stdout.strip() else ""
    if returncode == 0 and state:
        return state
    if "Invalid job id" in stderr or (returncode == 0 and not state):
        return GONE
    return None  # controller unreachable, timeout: ask again later, never stop a job on a guess


def job_state(job_id: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                             timeout=SQUEUE_TIMEOUT_S, stdin=subprocess.DEVNULL,
                             env=None if environ is None else dict(environ))
    except (subprocess.TimeoutExpired, OSError):
        return None
    return parse_squeue(out.returncode, out.stdout, out.stderr)


def poll_interval(environ: Mapping[str, str]) -> float:
    try:
        value = float(environ.get("DTRUN_SLURM_POLL_S", POLL_S))
    except ValueError:
        return POLL_S
    return value if value > 0 else POLL_S


def ended_message(job_id: str, state: str, what_now: str) -> str:
    state_text = "is gone" if state == GONE else f"is {state}"
    return f"dtrun: Slurm job {job_id} {state_text} (cancelled or out of time): {what_now}"


def ended_state(job_id: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The job's state if its allocation has ended (asked once), else None."""
    state = job_state(job_id, environ)
    return None if state is None or state in ALIVE else state


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # the launch's own handler stops the job and exits 143


def watch_allocation(job_id: str, environ: Optional[Mapping[str, str]] = None,
                     on_gone: Callable[[], None] = _stop_self,
                     state_of: Callable[[str], Optional[str]] = None) -> Callable[[], None]:
    """Start a daemon thread that calls ``on_gone`` once the allocation has ended.

    Returns a function that stops the watcher (call it when the job is over).
    """
    environ = os.environ if environ is None else environ
    interval = poll_interval(environ)
    state_of = state_of or (lambda jid: job_state(jid, environ))
    done = threading.Event()

    def loop() -> None:
        while not done.wait(interval):
            state = state_of(job_id)
            if state is None or state in ALIVE:
                continue
            if done.is_set():
                return
            print(ended_message(job_id, state, "stopping the job"), file=sys.stderr, flush=True)
            on_gone()
            return

    threading.Thread(target=loop, name="dtrun-allocwatch", daemon=True).start()
    return done.set
