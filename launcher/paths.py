"""Where dtrun keeps its files: caches (flavor detection, ssh configs, preflight results), run ids."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


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


def new_run_id(now: Optional[float] = None, pid: Optional[int] = None) -> str:
    """The subdirectory of --log-dir for one run: start time, dtrun's pid and a random part.

    The time sorts the runs; the random part keeps another user of a shared DIR from
    guessing the name and creating it first (``start_log_dir`` refuses one that exists).
    """
    import secrets
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{os.getpid() if pid is None else pid}-{secrets.token_hex(4)}"
