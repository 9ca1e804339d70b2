"""Running the installed dtrun console script as users do, with a timeout."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DTRUN = str(BIN / "dtrun")
PYTHON = str(BIN / "python")


def user_env(**extra):
    """The environment of a user who activated the virtual environment."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("OMPI_ALLOW_RUN_AS_ROOT", None)
    env.update(extra)
    return env


def dtrun(*args, timeout=120, env=None, cwd=REPO, **kw):
    return subprocess.run([DTRUN, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env or user_env(), cwd=cwd, stdin=subprocess.DEVNULL, **kw)
