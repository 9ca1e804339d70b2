"""Checkpoints for collectives.dp: rank 0 writes and reads the file, every rank gets the
result or the same error.

Writing: a temporary file created exclusively beside the path (``O_CREAT|O_EXCL|O_NOFOLLOW``,
an unpredictable name, mode 0600), flushed to disk, renamed over the path, then the directory
flushed. The file is a one-line header with the sha256 of what follows, then ``torch.save``'s
bytes. A save also removes the temporary files of the same checkpoint that earlier saves by
this user left behind (a killed job), when their writer is gone.

Reading: the path is opened without following a symbolic link and without blocking, and must
be a regular file owned by this user or root. The checksum is checked (a file ``torch.save``
wrote directly, without the header, loads without the check). ``torch.load`` runs with
``weights_only=True`` unless the caller passes ``trusted=True``.

collectives.dp holds the public functions; this module takes the communicator and its lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import secrets
import socket
import stat
import time
from typing import Any

import numpy as np
import torch

from . import objects as _objects
from .errors import CollectiveError

MAGIC = b"dtrun checkpoint v1 sha256="
HEADER_LEN = len(MAGIC) + 64 + 1  # the hex digest and a newline
STALE_AGE_S = 24 * 3600  # a temporary file untouched this long has no live writer
TRUSTED_HINT = ("load_checkpoint(path, trusted=True) loads it with full pickle, which runs any code "
                "the file holds: use it only for a file that only you can write")


class CheckpointError(CollectiveError, OSError):
    """A checkpoint could not be saved or loaded; raised on every rank with the same text."""


class _Refused(Exception):
    """A problem found on purpose (its text is the message, as it stands)."""


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor (in dicts, lists and tuples) detached and on the CPU."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def _describe(path: str, exc: Exception) -> str:
    if isinstance(exc, _Refused):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{path}: {exc.strerror}"
    return f"{path}: {type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- saving
def save(comm: Any, path: Any, state: Any, lock: Any = None) -> None:
    """Write ``state`` to ``path`` from rank 0 (see collectives.dp.save_checkpoint). Collective."""
    error = None
    if comm.rank == 0:
        path = os.fspath(path)
        try:
            _write(path, to_cpu(state))
        except Exception as exc:  # every failure must reach every rank, not only rank 0
            error = _describe(path, exc)
    error = _objects.broadcast_object(comm, error, 0, lock=lock)
    if error is not None:
        raise CheckpointError("save_checkpoint", 0, error)


def _tmp_prefix(path: str) -> str:
    return f".{os.path.basename(path)[:100]}.dtrun-tmp-"


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


class _HashingWriter:
    """What torch.save writes to: the file, with a running sha256 of the bytes."""

    def __init__(self, f: Any):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, b: Any) -> int:
        self.sha.update(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def _write(path: str, state: Any) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale(directory, _tmp_prefix(path))
    name = f"{_tmp_prefix(path)}{_host_tag()}-{os.getpid()}-{secrets.token_hex(8)}"
    tmp = os.path.join(directory, name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(HEADER_LEN))
            writer = _HashingWriter(f)
            torch.save(state, writer)
            f.seek(0)
            f.write(MAGIC + writer.sha.hexdigest().encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def remove_stale(directory: str, prefix: str, now: float | None = None) -> list[str]:
    """Unlink the temporary files named ``prefix...`` in ``directory`` that an earlier save
    left: regular files (never a link) owned by this user whose writer, on this host, is no
    longer running, or that nobody touched for a day. Best effort; returns the names removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        entries = [e for e in os.scandir(directory) if e.name.startswith(prefix)]
    except OSError:
        return removed
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)  # lstat: a link is never followed
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if now - st.st_mtime > STALE_AGE_S or _writer_gone(entry.name[len(prefix):]):
                os.unlink(entry.path)  # unlink removes the name itself, never what it points to
                removed.append(entry.name)
        except OSError:
            continue
    return removed


def _writer_gone(tail: str) -> bool:
    """Whether the process named by a temporary file's ``host-pid-random`` tail has ended."""
    m = re.fullmatch(r"([0-9a-f]{8})-(\d+)-[0-9a-f]+", tail)
    if m is None or m.group(1) != _host_tag():
        return False  # another host's writer (a shared file system): only the age decides
    pid = int(m.group(2))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, another user's
    return False


def fsync_dir(directory: str) -> None:
    """Make a rename durable (best effort: some file systems cannot open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- loading
def load(comm: Any, path: Any, trusted: bool = False, lock: Any = None) -> Any:
    """The state saved at ``path`` on every rank, or None when there is none (see
    collectives.dp.load_checkpoint). Collective."""
    status, data = None, None
    if comm.rank == 0:
        path = os.fspath(path)
        try:
            data = _read(path, trusted)
            status = ("none", 0, path) if data is None else ("ok", len(data), path)
        except Exception as exc:  # every failure must reach every rank, not only rank 0
            status = ("error", _describe(path, exc), path)
    kind, value, path = _objects.broadcast_object(comm, status, 0, lock=lock)
    if kind == "error":
        raise CheckpointError("load_checkpoint", 0, value)
    if kind == "none":
        return None
    payload = _broadcast_bytes(comm, data, value, lock)
    state, error = None, None
    try:
        state = _unpickle(payload, trusted)
    except Exception as exc:
        error = f"{path}: {_unpickle_problem(exc, trusted)}"
    errors = _objects.allgather_objects(comm, error, lock=lock)
    for rank, problem in enumerate(errors):
        if problem is not None:
            raise CheckpointError("load_checkpoint", rank, problem)
    return state


def _read(path: str, trusted: bool) -> memoryview | None:
    """The checked payload of the file at ``path`` (None when there is none)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise _Refused(f"{path}: is a symbolic link; load_checkpoint opens only the file "
                           "itself (pass the path it points to)") from exc
        raise
    with os.fdopen(fd, "rb") as f:
        _check_file(path, os.fstat(fd), trusted)
        data = f.read()
    return _payload(path, data)


def _check_file(path: str, st: os.stat_result, trusted: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _Refused(f"{path}: is not a regular file (a directory, FIFO, socket or device); "
                       "load_checkpoint reads only a file save_checkpoint wrote")
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise _Refused(f"{path}: is owned by uid {st.st_uid}, not by this user (uid {me}) or root; "
                       "load_checkpoint refuses a file another user could have written (copy it "
                       "to a file of your own if you trust it)")
    if trusted and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _Refused(f"{path}: is writable by group or others, so trusted=True (which runs code "
                       "from the file) is refused; chmod go-w it first")


def _payload(path: str, data: bytes) -> memoryview:
    """What torch.load reads: the bytes after a checked header, or the whole of a file
    torch.save wrote directly (no header, no checksum)."""
    if data[:len(MAGIC)] == MAGIC:
        body = memoryview(data)[HEADER_LEN:]
        digest = data[len(MAGIC):HEADER_LEN - 1]
        if data[HEADER_LEN - 1:HEADER_LEN] != b"\n" or hashlib.sha256(body).hexdigest().encode() != digest:
            raise _Refused(f"{path}: checksum mismatch: the file is damaged (a changed byte or a "
                           "truncated copy); restore it or load an older checkpoint")
        return body
    if data[:2] == b"PK" or data[:1] == b"\x80":
        return memoryview(data)
    raise _Refused(f"{path}: not a checkpoint, or its header is damaged (neither save_checkpoint's "
                   "header nor a torch.save file)")


def _broadcast_bytes(comm: Any, data: memoryview | None, n: int, lock: Any) -> memoryview:
    """Rank 0's ``n`` bytes on every rank."""
    if comm.size == 1:
        return data
    buf = np.frombuffer(data, dtype=np.uint8) if comm.rank == 0 else np.empty(n, dtype=np.uint8)
    if n:
        with lock if lock is not None else contextlib.nullcontext():
            comm.broadcast(buf, root=0, inplace=True)
    return memoryview(buf).cast("B")


def _unpickle(payload: memoryview, trusted: bool) -> Any:
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=not trusted)


def _unpickle_problem(exc: Exception, trusted: bool) -> str:
    text = str(exc)
    if not trusted and "Weights only load failed" in text:
        reason = re.search(r"^.*(?:GLOBAL|[Uu]nsupported).*$", text, re.M)
        why = f" ({reason.group(0).strip()[:200]})" if reason else ""
        return (f"holds objects that loading with weights_only refuses{why}; {TRUSTED_HINT}")
    return f"{type(exc).__name__}: {text}"
