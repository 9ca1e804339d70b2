"""``dtrun --version``: dtrun's own version and the MPI a launch would use."""
from __future__ import annotations

import os
from typing import Mapping, Optional

from launcher.errors import DtrunError


def dtrun_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dtrun")
    except PackageNotFoundError:
        return "unknown (not installed)"


def version_text(environ: Optional[Mapping[str, str]] = None) -> str:
    """Two lines: ``dtrun X`` and ``MPI: <flavor> <version> (<mpirun>)``, or why there is none."""
    from launcher.flavors import detect_flavor, find_mpirun

    environ = os.environ if environ is None else environ
    try:
        flavor = detect_flavor(find_mpirun(None, environ))
        mpi = f"{flavor.label} ({flavor.mpirun})"
    except DtrunError as exc:
        mpi = f"none usable: {exc}"
    return f"dtrun {dtrun_version()}\nMPI: {mpi}"
