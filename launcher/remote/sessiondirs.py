"""Open MPI 5 session directories that killed jobs left behind (standard library only).

Open MPI 5's runtime (PRRTE) gives mpirun and each remote daemon (prted) a session
directory named after the program and its pid: ``$TMPDIR/ompi.12345``,
``/tmp/prted.6789``. PMIx writes its rendezvous files there (``pmix.HOST.tool.PID``,
whose third line is the pid again) and removes the whole directory when the process
ends normally. A process that is killed (``kill -9``, a job dtrun had to stop, a lost
host) leaves it. PMIx 5.0 creates those files with O_EXCL, so the next mpirun or prted
that the kernel gives the same pid stops at once with

    The PMIx server's listener thread failed to start. We cannot continue.

and mpirun exits with code 213. Pids come round again quickly where ``pid_max`` is
32768 (a busy node or CI machine wraps in minutes). Later PMIx releases reclaim such a
file when its pid is gone; this module does the same for the releases that do not.

Deciding that a directory's process is gone by its pid alone is wrong where several pid
namespaces share the temporary directory (a container, a second login node sharing /tmp):
a live mpirun there has a pid that names nothing here. So liveness is decided by what every
namespace on the host sees, an ``flock`` on ``LOCK_NAME`` in the directory: dtrun holds it
in mpirun's directory while the job runs (``LauncherLock``, from its first rank's start:
mpirun is then past PMIx's start, so the directory is its own), and a keeper process
started by each host's rank wrapper holds it in the daemon's ``prted.PID`` for as long as
that daemon lives (``keep_daemon_dir``). A directory is removed only when all of these hold,
so a live session is never touched: its name is ``NAME.PID``; it is ours (same uid, not a
symlink); it holds a PMIx rendezvous file whose third line is that same PID; it holds our
lock file (a regular file of ours, never followed through a symlink) and nobody holds the
lock; and no process has that PID in this pid namespace. A directory without our lock file
(a bare mpirun's, another namespace's) is kept, as is one whose lock holder ended before the
process (its pid is alive).

dtrun sweeps the launching host before and after every Open MPI 5 job, each host's local
rank 0 sweeps its host while the job runs (``launcher/remote/rankexec.py``), the kill agent sweeps
after it kills a job's daemons (``launcher/remote/agent.py``) and a daemon's keeper removes
the directory the daemon left when it was killed, so a killed job's leftovers are gone
before the next job there; ``dtrun doctor`` lists what is left on each host
(the probe, ``launcher/remote/probe.py``, runs this module).
"""
import sys

if __name__ == "__main__":  # started as a script, or shipped as one program (bundle)
    if "launcher.remote" not in sys.modules:
        import os
        sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import launcher.remote  # noqa: F401 (the package of its siblings, in this process only)
    __package__ = "launcher.remote"  # PEP 366: the relative imports below find the siblings

import os
import re
import shutil
import stat
import threading
import time

from .procfs import proc_start

try:
    import fcntl
except ImportError:  # no flock: no lock can be proven free, so nothing is ever removed
    fcntl = None

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_+-]{0,63}\.([0-9]{1,10})$")
_RENDEZVOUS_PREFIX = "pmix."
MAX_ENTRIES = 20000  # a /tmp larger than this is not scanned (the sweep must stay cheap)
LOCK_NAME = "dtrun.lock"
MPIRUN_DIR = "ompi"  # mpirun's (prterun's) session directory: ompi.PID
DAEMON_DIR = "prted"  # a remote daemon's: prted.PID
TAKE_OVER_TRIES = 5  # a lock file already there: tries, TAKE_OVER_WAIT_S apart, to take it over
TAKE_OVER_WAIT_S = 0.2
FILE_CLOCK_SLACK_S = 0.05


def top_dir(environ=None) -> str:
    """Where PRRTE puts session directories: TMPDIR, TEMP or TMP if set, else /tmp."""
    environ = os.environ if environ is None else environ
    for var in ("TMPDIR", "TEMP", "TMP"):
        if environ.get(var):
            return environ[var]
    return "/tmp"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: it exists and is someone else's
    return True


def _records_pid(path: str, pid: int) -> bool:
    """Whether ``path`` is a PMIx rendezvous file written by ``pid`` (its third line)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        head = os.read(fd, 4096).split(b"\n")
    except OSError:
        return False
    finally:
        os.close(fd)
    return len(head) > 2 and head[2].strip() == str(pid).encode()


def _open_ours(path: str, uid: int):
    """A descriptor of ``path`` when it is our lock file (a regular file of ``uid``, not
    reached through a symlink), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def claim(path: str, uid=None):
    """The lock of our lock file ``path`` when nobody holds it (its holder is gone): the
    descriptor that holds it now, to close when done. None when the file is missing, is not
    ours, is held by a live process in any pid namespace of the host, or cannot be locked."""
    if fcntl is None:
        return None
    uid = os.getuid() if uid is None else uid
    fd = _open_ours(path, uid)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):  # still the file at that name
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def held(path: str, uid=None) -> bool:
    """Whether our lock file ``path`` is locked by a live process (in any pid namespace)."""
    if fcntl is None:
        return False
    fd = _open_ours(path, os.getuid() if uid is None else uid)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def hold(session_dir: str, uid=None):
    """Put our lock file in ``session_dir`` and hold its lock: the descriptor (keep it open
    while the directory's process lives), or None when another holder has it, or the
    directory is gone or not ours.

    The file is made and locked under a temporary name and then linked into place, so no
    sweep ever finds it unlocked; one already there whose holder ended is taken over."""
    if fcntl is None:
        return None
    uid = os.getuid() if uid is None else uid
    try:
        st = os.stat(session_dir, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        return None
    final = os.path.join(session_dir, LOCK_NAME)
    tmp = os.path.join(session_dir, f".{LOCK_NAME}.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    linked = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file that nobody else has open
        os.write(fd, f"{os.getpid()}\n".encode())
        os.link(tmp, final)
        linked = True
    except OSError as exc:
        os.close(fd)
        if not isinstance(exc, FileExistsError):
            return None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    if linked:
        return fd
    for attempt in range(TAKE_OVER_TRIES):
        if attempt:
            time.sleep(TAKE_OVER_WAIT_S)  # a sweep may hold it for the moment it looks
        fd = claim(final, uid)
        if fd is not None:
            return fd
    return None


def _candidates(top: str, uid: int):
    """(path, pid) of the session directories in ``top`` whose process is not alive in this
    pid namespace: ours, named NAME.PID, with a PMIx rendezvous file recording that PID."""
    found = []
    try:
        with os.scandir(top) as it:
            for n, entry in enumerate(it):
                if n >= MAX_ENTRIES:
                    break
                m = _NAME_RE.match(entry.name)
                if not m:
                    continue
                pid = int(m.group(1))
                if pid <= 1 or pid > 0x7FFFFFFF:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not entry.is_dir(follow_symlinks=False) or st.st_uid != uid or alive(pid):
                    continue
                try:
                    names = [e for e in os.listdir(entry.path) if e.startswith(_RENDEZVOUS_PREFIX)]
                except OSError:
                    continue
                if any(_records_pid(os.path.join(entry.path, e), pid) for e in names[:8]):
                    found.append((entry.path, pid))
    except OSError:
        return []
    return found


def stale(top: str, uid=None) -> list:
    """Paths of the session directories in ``top`` that are provably dead (see the module doc)."""
    uid = os.getuid() if uid is None else uid
    found = []
    for path, _pid in _candidates(top, uid):
        fd = claim(os.path.join(path, LOCK_NAME), uid)
        if fd is not None:
            os.close(fd)
            found.append(path)
    return found


def sweep(environ=None) -> list:
    """Remove this host's provably dead session directories; the paths removed (never raises).

    Each is removed while its lock is held, so no holder can take it in between."""
    uid = os.getuid()
    removed = []
    for path, pid in _candidates(top_dir(environ), uid):
        fd = claim(os.path.join(path, LOCK_NAME), uid)
        if fd is None:
            continue
        try:
            if not alive(pid):
                shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def _start_ticks(pid: int):
    """When process ``pid`` started (clock ticks since boot), or None: tells it from a later
    process given the same pid."""
    return (proc_start(pid) or (None, None))[1]


def keep_daemon_dir(pid: int, environ=None):
    """Start the keeper of the MPI daemon ``pid``'s session directory (``prted.PID``): a
    process of its own that holds the lock there for as long as the daemon lives (a rank
    wrapper ends before its daemon). Returns its pid, or None where the daemon has no such
    directory here (not Open MPI 5's prted: on dtrun's host mpirun's is held by dtrun)."""
    path = os.path.join(top_dir(environ), f"{DAEMON_DIR}.{pid}")
    start = _start_ticks(pid)
    if start is None or not os.path.isdir(path) or os.path.islink(path):
        return None
    import subprocess

    try:
        p = subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), "hold", path, str(pid), str(start)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    except OSError:
        return None
    return p.pid


def _keep(path: str, pid: int, start: int) -> int:
    """The keeper: hold the lock in ``path`` while process ``pid`` (started at ``start``)
    lives, then remove the directory if the process left it (it was killed)."""
    pidfd = None
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pass
    if _start_ticks(pid) != start:
        return 0  # the daemon is gone already (and the pid perhaps someone else's)
    fd = hold(path)
    if fd is None:
        return 0
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return 0
    if pidfd is not None:
        import select

        select.select([pidfd], [], [])  # readable once the process has ended
    else:
        while _start_ticks(pid) == start:
            time.sleep(1.0)
    try:
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            shutil.rmtree(path, ignore_errors=True)  # while the lock is still held
    except OSError:
        pass
    return 0


class LauncherLock:
    """Holds the lock in mpirun's own session directory (``ompi.PID``) while the job runs.

    A job observer of ``launcher.job.supervisor``'s ``run_job`` (the same methods as its
    ``JobObserver``; this module stays standard library only). The lock is taken at the
    first rank's start: mpirun is then past PMIx's start, which refuses a directory that
    is not its own, so the directory is this job's. Until then it has no lock file and
    every sweep keeps it. Make it just before starting mpirun.
    """

    def __init__(self, environ=None):
        self.top = top_dir(environ)
        # Before mpirun starts: what it writes is newer. File times come from the kernel's
        # coarse clock, up to a tick behind time.time(): allow for that.
        self.started = time.time() - FILE_CLOCK_SLACK_S
        self.pid = None
        self.fd = None
        self._thread = None

    def path(self) -> str:
        return os.path.join(self.top, f"{MPIRUN_DIR}.{self.pid}")

    def on_start(self, job) -> None:
        self.pid = job.pid

    def on_output(self, _stream, _data) -> None:
        pass

    def on_rank_start(self, _rank, _host) -> None:
        if self._thread is None and self.pid is not None:
            self._thread = threading.Thread(target=self._hold, name="dtrun-session-lock", daemon=True)
            self._thread.start()  # off the output pump: taking over a lock may wait a moment

    def _hold(self) -> None:
        self.fd = hold(self.path())

    def on_rank_exit(self, _failure) -> None:
        pass

    def on_signal(self, _signum) -> bool:
        return False

    def on_end(self, result) -> None:
        """mpirun has ended: let go, so that the next sweep removes a directory it left.

        A job that ended before any rank started gets a lock file (free) only where the
        directory is provably its mpirun's: PMIx did not refuse it, and mpirun wrote its
        rendezvous file there after the job began (another's was there before)."""
        if self._thread is not None:
            self._thread.join(timeout=TAKE_OVER_TRIES * TAKE_OVER_WAIT_S + 5)
        if self.fd is None and self.pid is not None and not getattr(result, "pmix_refused", None) \
                and self._written_since_start():
            self.fd = hold(self.path())
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _written_since_start(self) -> bool:
        path = self.path()
        try:
            names = [e for e in os.listdir(path) if e.startswith(_RENDEZVOUS_PREFIX)]
        except OSError:
            return False
        for name in names[:8]:
            f = os.path.join(path, name)
            try:
                if os.stat(f, follow_symlinks=False).st_mtime >= self.started and _records_pid(f, self.pid):
                    return True
            except OSError:
                continue
        return False


if __name__ == "__main__" and sys.argv[1:2] == ["hold"] and len(sys.argv) == 5:
    # The keeper (keep_daemon_dir): sessiondirs.py hold DIR PID START
    sys.exit(_keep(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
