"""The command reference page, generated from the CLI itself so that it cannot drift.

It runs ``python -m dtrun --help`` and ``python -m dtrun SUB --help`` for every
subcommand (``dtrun.launcher.cli.SUBCOMMANDS``) with the Python that runs this script, and
renders their output as one Markdown page. ``docs/hooks.py`` calls ``render()`` on every
``mkdocs build``, so the page exists only in the built site (``reference.md`` is never a
file in the tree). By hand: ``python docs/gen_cli_reference.py [OUT.md]`` (stdout without OUT).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A fixed width, no colour: the page is the same whatever terminal builds it.
_ENV = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb", "PYTHONPATH": str(ROOT)}


def subcommands() -> tuple[str, ...]:
    """The subcommand names, as the CLI lists them."""
    sys.path.insert(0, str(ROOT))
    try:
        from dtrun.launcher.cli import SUBCOMMANDS
    finally:
        sys.path.remove(str(ROOT))
    return tuple(SUBCOMMANDS)


def cli_help(*args: str) -> str:
    """``dtrun ARGS --help`` as the CLI prints it; raises if the CLI fails."""
    env = {**os.environ, **_ENV}
    proc = subprocess.run([sys.executable, "-m", "dtrun", *args, "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"dtrun {' '.join(args)} --help exited with {proc.returncode}: "
                           f"{proc.stderr.strip()[-500:]}")
    return proc.stdout.rstrip() + "\n"


def _block(text: str) -> str:
    return "```text\n" + text + "```\n"


def render() -> str:
    """The whole reference page as Markdown."""
    subs = subcommands()
    parts = [
        "# Command reference\n",
        "Generated at build time from `dtrun --help` and each subcommand's `--help`, so it always\n"
        "matches the CLI it was built from. The topic pages explain what the options are for.\n",
        "## dtrun\n",
        "Launch a program on the hosts ([Launching a job](launching.md)).\n",
        _block(cli_help()),
    ]
    for sub in subs:
        parts += [f"## dtrun {sub}\n", _block(cli_help(sub))]
    return "\n".join(parts)


if __name__ == "__main__":
    page = render()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(page)
    else:
        sys.stdout.write(page)
