"""Where dtrun keeps its caches (flavor detection, generated ssh configs, preflight results)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dtrun``, else ``~/.cache/dtrun``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dtrun"


def atomic_write(path: Path | str, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half.

    Another dtrun may read or write the same cache file at the same moment: the text goes
    to a temporary file beside ``path`` (never through a symlink), then a rename puts it
    in place. The directory is created private (0700) when missing.

    Raises:
        OSError: the directory or file cannot be written (callers of a cache ignore it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)  # os.open's mode passes through the umask
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
