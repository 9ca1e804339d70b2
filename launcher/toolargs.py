"""The command lines of ``dtrun smoke`` and ``dtrun bench``: launch options and the tool's own, mixed.

``dtrun bench -np 2 -b 1M -e 64M -f 2 -o all`` is how nccl-tests users type it. Each
option goes to whoever declares it: the tool's argparse parser (collectives/smoke.py,
collectives/bench.py) or the launch command. Where both declare a name, the tool's
meaning wins, because that is what its users expect: in ``dtrun bench``, ``-f`` is the
size step factor and ``-n`` the iteration count, as in nccl-tests; the launcher's
``--hostfile`` and ``-np`` are spelled out there. The tool's arguments are checked here,
before anything starts, so a typo is a usage error rather than a failure on every rank.
"""
from __future__ import annotations

import contextlib
import io
import sys
from typing import Optional

from dtrun.launcher.errors import UsageError
from dtrun.launcher.optargs import LaunchArgv, OptionWords, no_such_option, take_option

# The tools dtrun runs on every rank: ``dtrun smoke|bench`` -> the module each rank runs.
TOOLS = {"smoke": "dtrun.collectives.smoke", "bench": "dtrun.collectives.bench"}


def tool_parser(tool: str):
    """The tool's module, which builds its argparse parser (importing it leaves os.environ alone)."""
    import importlib

    return importlib.import_module(TOOLS[tool])


def parser_table(parser) -> dict[str, int]:
    """Option name -> number of values, from an argparse parser (help left out: dtrun answers it)."""
    table = {}
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0 and action.dest == "help":
            continue
        n = 1 if action.nargs is None else (action.nargs if isinstance(action.nargs, int) else 1)
        for name in action.option_strings:
            table[name] = n
    return table


def split_tool_argv(tool: str, argv: list[str], launch: dict[str, int],
                    own: dict[str, int]) -> tuple[OptionWords, list[str]]:
    """(launch options, tool arguments); everything after ``--`` goes to the tool."""
    launch_args, tool_args, i = OptionWords(), [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            tool_args += argv[i + 1:]
            break
        if not a.startswith("-") or a == "-":
            raise UsageError(f"dtrun {tool} runs its own program; unexpected {a!r} (see dtrun {tool} --help)")
        name = a.partition("=")[0] if a.startswith("--") else a
        if name in own:
            taken, i = take_option(argv, i, own)
            tool_args += taken
        elif name in launch:
            taken, i = take_option(argv, i, launch)
            launch_args.add(taken)
        else:
            raise no_such_option(name, set(own) | set(launch))
    return launch_args, tool_args


# What to say when a value fails the tool's own check and the launch meaning was likely meant.
_SHADOW_HINTS = {"-f": "--hostfile FILE", "-n": "-np N"}


def check_tool_args(tool: str, module, tool_args: list[str]) -> None:
    """Run the tool's own parser here, so bad arguments stop before any rank starts."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            module.parse_args(tool_args)
        except SystemExit as exc:
            if not exc.code:
                return
            lines = [ln for ln in err.getvalue().strip().splitlines() if ln.strip()]
            msg = lines[-1] if lines else "invalid arguments"
            msg = msg.split(": error: ", 1)[-1]
            hint = ""
            for short, launch_form in _SHADOW_HINTS.items():
                if short in tool_args and f"argument {short}/" in msg:
                    hint = (f" (in dtrun {tool}, {short} is the tool's own option, as in nccl-tests; "
                            f"for the launcher use {launch_form})")
            raise UsageError(f"{tool}: {msg}{hint}") from None


def tool_help(tool: str, module, launch: dict[str, int]) -> str:
    parser = module.build_parser()
    parser.prog = f"dtrun {tool}"
    parser.usage = f"dtrun {tool} [LAUNCH OPTIONS] [{tool.upper()} OPTIONS] [-- {tool.upper()} OPTIONS]"
    own = parser_table(parser)
    shadowed = sorted(n for n in launch if n in own and n not in ("-h", "--help"))
    launch_names = sorted(n for n in launch if n not in own and n not in ("-h", "--help", "--version"))
    import textwrap

    text = parser.format_help().replace("options:\n", f"{tool} options:\n", 1)
    text += (f"\nlaunch options (as for `dtrun --help`; every rank runs `python -m {TOOLS[tool]}`):\n"
             + textwrap.fill(" ".join(launch_names), width=78, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False) + "\n")
    if shadowed:
        hinted = [_SHADOW_HINTS[n] for n in shadowed if n in _SHADOW_HINTS]
        lost = [n for n in shadowed if n not in _SHADOW_HINTS]
        note = (f"In dtrun {tool}, {' and '.join(shadowed)} mean {tool}'s own option{'s' if len(shadowed) > 1 else ''}"
                " above (as in nccl-tests)" if tool == "bench" else
                f"In dtrun {tool}, {' and '.join(shadowed)} mean{'s' if len(shadowed) == 1 else ''} {tool}'s own "
                f"option{'s' if len(shadowed) > 1 else ''} above")
        if hinted:
            note += f"; for the launcher's, write {' and '.join(hinted)}"
        if lost:
            note += f"; the launcher's {' and '.join(lost)} cannot be given here"
        text += "\n" + textwrap.fill(note + ".", width=78) + "\n"
    return text


def tool_launch_argv(tool: str, argv: list[str], launch: dict[str, int]) -> Optional[LaunchArgv]:
    """``dtrun smoke|bench ARGS`` as the launch command's: its options, and the tool's run as PROGRAM.

    Returns None after printing the help that ``-h``/``--help`` asked for.
    """
    module = tool_parser(tool)
    before_program = argv[:argv.index("--")] if "--" in argv else argv
    if any(a in ("-h", "--help") for a in before_program):
        sys.stdout.write(tool_help(tool, module, launch))
        return None
    own = parser_table(module.build_parser())
    launch_args, tool_args = split_tool_argv(tool, argv, launch, own)
    check_tool_args(tool, module, tool_args)
    return launch_args.argv([sys.executable, "-m", TOOLS[tool]] + tool_args)
