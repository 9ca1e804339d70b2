"""Where dtrun keeps its caches (flavor detection, generated ssh configs, preflight results)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dtrun``, else ``~/.cache/dtrun``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dtrun"
