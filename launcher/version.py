"""``dtrun --version``: dtrun's own version and the MPI a launch would use."""
from __future__ import annotations

import os
from typing import Mapping, Optional

from dtrun.launcher.errors import DtrunError
from dtrun.launcher.flavors import detect_flavor, find_mpirun


def dtrun_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dtrun")
    except PackageNotFoundError:
        return "unknown (not installed)"


def installed_at() -> str:
    """Where the ``dtrun`` package runs from (site-packages, a pipx venv, or a source tree)."""
    import dtrun

    return os.path.dirname(os.path.abspath(dtrun.__file__))


def version_text(environ: Optional[Mapping[str, str]] = None) -> str:
    """Three lines: ``dtrun X``, ``MPI: <flavor> <version> (<mpirun>)`` (or why there is none)
    and ``installed at: <dir>``."""
    environ = os.environ if environ is None else environ
    try:
        flavor = detect_flavor(find_mpirun(None, environ))
        mpi = f"{flavor.label} ({flavor.mpirun})"
    except DtrunError as exc:
        mpi = f"none usable: {exc}"
    return f"dtrun {dtrun_version()}\nMPI: {mpi}\ninstalled at: {installed_at()}"
