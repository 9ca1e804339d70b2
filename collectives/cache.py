"""A small JSON cache file per user, shared by the ranks of a host (the path selector's).

``collectives`` runs inside user programs and imports nothing from ``launcher/``; this is
the few lines of its cache-location rule it needs: ``$XDG_CACHE_HOME/dtrun``, else
``~/.cache/dtrun``. Writes are atomic (temporary file, then rename) because several jobs
may write the same file at once; a file that does not parse is treated as empty.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dtrun"


def load(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when missing, unreadable or corrupt."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def save(path: Path, doc: dict) -> bool:
    """Write ``doc`` atomically; False (and no exception) when the disk refuses."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
