"""Exceptions raised by the launcher and the one place that maps them to exit codes.

Library errors (OSError, subprocess, yaml) are translated into these at the
boundary so the CLI can print one line naming the file, line or argument.
"""
from __future__ import annotations

import signal
from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of the dtrun command (a job's own code passes through unchanged)."""

    OK = 0
    FAILED = 1  # a check failed, or the job failed without a code of its own
    USAGE = 2  # bad input: arguments, hostfiles, a missing mpirun
    TIMEOUT = 124  # --timeout or --start-timeout stopped the job (as timeout(1) reports it)
    RESTARTS = 123  # --max-restarts used up, or too few slots left for --min-np (launcher/restarts.py)
    HANG = 125  # --hang-timeout with --on-hang abort: no progress, dtrun stopped the job
    INTERRUPTED = 130  # Ctrl-C / SIGINT, as shells report it


def signal_exit_code(signum: int) -> int:
    """Shell convention for a process killed by a signal: 128 + signal number."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class DtrunError(Exception):
    """Base of everything dtrun reports as a one-line error."""

    exit_code: int = ExitCode.FAILED


class UsageError(DtrunError):
    """Bad input from the user: exit code 2, nothing started."""

    exit_code = ExitCode.USAGE


class HostfileError(UsageError):
    """A hostfile, cluster file or -H list that cannot be parsed."""

    def __init__(self, source: str, line: int | None, message: str):
        self.source, self.line, self.message = source, line, message
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")


class UnknownHostError(UsageError):
    """--include / --exclude named a host that is not in the host list."""


class MpiNotFoundError(UsageError):
    """No usable mpirun was found, or --mpirun names something that is not one."""


class MpiFlavorError(UsageError):
    """mpirun answered --version with something dtrun does not recognise."""


class LaunchError(DtrunError):
    """The job could not be started (exec failure and the like)."""


class InvalidValue(UsageError):
    """A value that fails one of the grammars in launcher/safe.py (the caller adds where it came from)."""
