"""Elastic commits kept on each host's own disk, so that a restarted job resumes from its
last commit without a shared file system (``hvd.elastic``'s ``state.commit()``).

dtrun gives every rank of a run with restarts the run's id (``DTRUN_RUN_ID``, the same in
each attempt). One rank per host (local rank 0) writes each commit to
``<cache>/commits/<run id>/<host>/commit``, where ``<cache>`` is ``$XDG_CACHE_HOME/dtrun`` or
``~/.cache/dtrun`` on that host. A rank only ever reads its own host's file: when a host is
lost, its commit goes with it and a surviving host's serves the job.

Writing: a temporary file created exclusively (``O_CREAT|O_EXCL|O_NOFOLLOW``, an
unpredictable name, mode 0600) in the host's directory, then renamed over ``commit``: a
reader sees the last whole commit, never half of one. No fsync: the commit must outlive the
processes of a failed attempt, not the host's kernel (a host that crashes is left out).

Reading: every directory from ``commits`` down must be a real directory (not a symbolic
link) owned by this user with no access for others, and the file a regular file owned by
this user, opened without following a link; its header's length and crc32 must match (a
check against damage: the ownership checks are what keep out other users). Only then is it
unpickled: nobody but this user could have written it.
"""

import os
import re
import secrets
import socket
import stat
import typing
import zlib

RUN_ID_ENV = "DTRUN_RUN_ID"
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,99}")
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
MAGIC = b"dtrun commit v1"
_HEADER_RE = re.compile(rb"dtrun commit v1 seq=(\d{1,18}) size=(\d{1,6}) len=(\d{1,15}) crc32=([0-9a-f]{8})\n")
_MAX_HEADER = 160
FILE = "commit"


class CommitStoreError(OSError):
    """The host's commit directory or file is not one only this user could have written."""


class Commit(typing.NamedTuple):
    seq: int  # commits made in the run so far, this one included
    size: int  # ranks in the job that made it
    payload: bytes


def cache_root(environ=os.environ) -> str:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dtrun")


def run_id(environ=os.environ) -> typing.Optional[str]:
    """This run's id when dtrun restarts it (``--max-restarts``), else None (no store)."""
    rid = environ.get(RUN_ID_ENV, "")
    return rid if _RUN_ID_RE.fullmatch(rid) else None


class Store:
    """One host's commits of one run."""

    def __init__(self, run: str, root: typing.Optional[str] = None, host: typing.Optional[str] = None):
        if not _RUN_ID_RE.fullmatch(run):
            raise ValueError(f"{RUN_ID_ENV}={run!r}: not a run id")
        host = host or socket.gethostname()
        if not _HOST_RE.fullmatch(host) or host in (".", ".."):
            raise ValueError(f"host name {host!r} cannot name a directory")
        self.root = os.path.join(root or cache_root(), "commits")
        self.run_dir = os.path.join(self.root, run)
        self.dir = os.path.join(self.run_dir, host)
        self.path = os.path.join(self.dir, FILE)

    # -- directories
    def _chain(self) -> tuple[str, ...]:
        return self.root, self.run_dir, self.dir

    def _ensure_dirs(self) -> None:
        os.makedirs(os.path.dirname(self.root), mode=0o700, exist_ok=True)
        for d in self._chain():
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
            _check_private_dir(d)

    def _dirs_ok(self) -> bool:
        """Whether the directories exist; raises when one exists but is not private and ours."""
        for d in self._chain():
            try:
                _check_private_dir(d)
            except FileNotFoundError:
                return False
        return True

    # -- the commit
    def write(self, seq: int, size: int, payload: bytes) -> None:
        """Replace this host's commit with ``payload`` (commit number ``seq`` of a ``size``-rank job)."""
        self._ensure_dirs()
        header = b"%s seq=%d size=%d len=%d crc32=%08x\n" % (MAGIC, seq, size, len(payload), zlib.crc32(payload))
        tmp = os.path.join(self.dir, f".commit.{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def read(self) -> typing.Optional[Commit]:
        """This host's last commit, None when there is none.

        Raises:
            CommitStoreError: a directory or the file is not this user's own and private, or
                the file is not a whole commit.
        """
        if not self._dirs_ok():
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CommitStoreError(f"{self.path}: cannot be opened as a commit ({exc.strerror}); "
                                   "it is not a file this user wrote") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise CommitStoreError(f"{self.path}: not a private regular file of this user "
                                       f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); "
                                       "refusing to load it")
            head = f.readline(_MAX_HEADER)
            m = _HEADER_RE.fullmatch(head)
            if m is None:
                raise CommitStoreError(f"{self.path}: not a dtrun commit (bad header)")
            seq, size, length, digest = int(m[1]), int(m[2]), int(m[3]), m[4].decode()
            if st.st_size != len(head) + length:
                raise CommitStoreError(f"{self.path}: {st.st_size - len(head)} bytes after the header, "
                                       f"the header says {length}")
            payload = f.read(length)
        if len(payload) != length or f"{zlib.crc32(payload):08x}" != digest:
            raise CommitStoreError(f"{self.path}: its crc32 does not match its header (a damaged file)")
        return Commit(seq, size, payload)

    def remove(self) -> None:
        """Remove this host's commit and, when empty, its directories (the run ended well)."""
        try:
            if not self._dirs_ok():
                return
        except CommitStoreError:
            return
        for name in os.listdir(self.dir):
            if name == FILE or name.startswith(".commit."):
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass
        for d in (self.dir, self.run_dir):
            try:
                os.rmdir(d)
            except OSError:
                break


def _check_private_dir(path: str) -> None:
    """``path`` is a directory, not a link, owned by this user, closed to others.

    Raises:
        FileNotFoundError: it does not exist.
        CommitStoreError: it is anything else.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CommitStoreError(f"{path}: not a directory (a symbolic link or a file); refusing to keep or "
                               "load commits there")
    if st.st_uid != os.geteuid():
        raise CommitStoreError(f"{path}: owned by uid {st.st_uid}, not this user ({os.geteuid()}); refusing "
                               "to keep or load commits there")
    if st.st_mode & 0o077:
        raise CommitStoreError(f"{path}: mode {stat.S_IMODE(st.st_mode):o} lets others in; make it 700 "
                               f"(chmod 700 {path}) or remove it")


def for_this_run(environ=os.environ) -> typing.Optional[Store]:
    """This host's store when dtrun restarts the run, else None."""
    rid = run_id(environ)
    return Store(rid, cache_root(environ)) if rid else None


def forget(run: str, environ=os.environ) -> bool:
    """Remove this host's commits of the run ``run`` (the run is over); False for a bad id."""
    try:
        Store(run, cache_root(environ)).remove()
    except ValueError:
        return False
    return True
