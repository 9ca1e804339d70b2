"""The ``dtrun`` console script: every stop signal is caught before anything else is imported.

Importing the command line (typer, the launcher) takes a while; a signal in that time must
end dtrun the same documented way as one a minute later (launcher.job.stopsignals).
"""
from __future__ import annotations

import signal
import sys

from dtrun.launcher.job import stopsignals


def main() -> None:
    stopsignals.install()
    try:
        from dtrun.launcher.cli import main as cli_main  # lazy: signals are caught before typer is imported
    except stopsignals.Stopped as exc:  # the same line as a stop a moment later (cli.main)
        print(f"dtrun: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
        sys.exit(stopsignals.exit_code(exc.signum))
    cli_main()
