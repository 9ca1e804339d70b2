"""Reading dtrun's option words by hand: how many values each takes, and where PROGRAM starts.

click parses an option's values only after dtrun has found where its own options end and
the program's arguments begin; ``launcher/cli.py`` (the launch command) and
``launcher/toolargs.py`` (``dtrun smoke|bench``) both split argv with these functions, once,
into a ``LaunchArgv``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from dtrun.launcher.errors import UsageError

# Options that take more than one value. click options take one, so ``--mca KEY VALUE``
# (mpirun's spelling) is read here into a pair and never reaches click (LaunchArgv.mca).
_MULTI_VALUE = {"--mca": 2}
_MCA_KEY = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass(frozen=True)
class LaunchArgv:
    """The launch command's argv, read once: the option words click parses, the ``--mca``
    pairs (read here: click options take one value), PROGRAM with its arguments, whether
    ``--traceback`` was given, and the first bad option word (raised once that is known)."""

    options: tuple[str, ...] = ()
    mca: tuple[tuple[str, str], ...] = ()
    program: tuple[str, ...] = ()
    traceback: bool = False
    error: Optional[UsageError] = field(default=None, compare=False)

    def click_args(self) -> list[str]:
        """The arguments click parses: the options, ``--``, then PROGRAM."""
        return list(self.options) + (["--", *self.program] if self.program else [])


class OptionWords:
    """Option words as take_option returns them, with ``--mca``'s pairs kept apart."""

    def __init__(self) -> None:
        self.options: list[str] = []
        self.mca: list[tuple[str, str]] = []

    def add(self, taken: list[str]) -> None:
        if taken[0] == "--mca":
            self.mca.append((taken[1], taken[2]))
        else:
            self.options += taken

    def argv(self, program, traceback: bool = False, error: Optional[UsageError] = None) -> LaunchArgv:
        return LaunchArgv(tuple(self.options), tuple(self.mca), tuple(program), traceback, error)


def option_table(command) -> dict[str, int]:
    """Every option name of a click command (help included) -> how many values it takes.

    Derived from the command itself, so an option added to a typer command is known
    to the pass-through logic without a second list to keep.
    """
    table: dict[str, int] = {}
    for p in command.params:
        if getattr(p, "param_type_name", "") != "option":
            continue
        n = 0 if (p.is_flag or p.count) else p.nargs
        for name in p.opts:
            table[name] = _MULTI_VALUE.get(name, n)
        for name in p.secondary_opts:  # --no-tag-output and the like
            table[name] = 0
    for name in (command.context_settings or {}).get("help_option_names", ["--help"]):
        table[name] = 0
    return table


def no_such_option(name: str, known) -> UsageError:
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return UsageError(f"no such option {name}{hint}")


def take_option(argv: list[str], i: int, table: dict[str, int]) -> tuple[list[str], int]:
    """Read the option at ``argv[i]`` with its values; return (normalised args, next index).

    ``--name=value`` and ``--name value`` both work; a missing, empty or ``--`` value is
    a usage error, so an option never swallows the ``--`` that starts the program.
    """
    a = argv[i]
    name, eq, inline = a.partition("=") if a.startswith("--") else (a, "", "")
    n = table.get(name)
    if n is None:
        raise no_such_option(name, table)
    if n == 0:
        if eq:
            raise UsageError(f"{name} takes no value (got {a!r})")
        return [name], i + 1
    if eq:
        if n > 1:
            raise UsageError(f"{name} takes {n} values: {name} {_metavar(name)} (got {a!r})")
        values, nxt = [inline], i + 1
    else:
        values, nxt = argv[i + 1:i + 1 + n], i + 1 + n
    if len(values) < n or any(v == "--" for v in values):
        raise UsageError(f"{name} needs {'a value' if n == 1 else _metavar(name)}"
                         + (" before --" if "--" in values else ""))
    if any(v == "" for v in values):
        raise UsageError(f"{name}: empty value")
    if name == "--mca" and not _MCA_KEY.match(values[0]):
        raise UsageError(f"--mca {values[0]!r}: not an MCA parameter name (letters, digits, _): --mca KEY VALUE")
    return [name, *values], nxt


def _metavar(name: str) -> str:
    return "KEY VALUE" if name == "--mca" else "VALUE"


def read_launch_argv(argv: list[str], table: dict[str, int]) -> LaunchArgv:
    """dtrun's own options, and PROGRAM with its arguments (never parsed by dtrun).

    PROGRAM starts at the first word that is not an option or an option's value, or
    after ``--``. An unknown option before it is an error, not a program: the first such
    error is kept in ``error``, and the words after it are still looked at for
    ``--traceback`` only (as if each known option took its values), so that the error can
    show its traceback.
    """
    words, i, error, traceback = OptionWords(), 0, None, False
    while i < len(argv) and argv[i] != "--" and argv[i].startswith("-") and argv[i] != "-":
        word = argv[i]
        traceback = traceback or word == "--traceback"
        if error is None:
            try:
                taken, i = take_option(argv, i, table)
                words.add(taken)
                continue
            except UsageError as exc:
                error = exc
        inline = word.startswith("--") and "=" in word
        i += 1 + (0 if inline else table.get(word, 0))
    program = argv[i + 1:] if i < len(argv) and argv[i] == "--" else argv[i:]
    return words.argv(program, traceback, error)
