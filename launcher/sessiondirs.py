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

A directory is removed only when all of these hold, so a live session is never touched:
its name is ``NAME.PID``; it is ours (same uid, not a symlink); it holds a PMIx
rendezvous file whose third line is that same PID; and no process has that PID (in
this pid namespace). dtrun sweeps the launching host before and after every Open MPI 5
job, each host's local rank 0 sweeps its host while the job runs (``launcher/rankexec.py``),
and the kill agent sweeps after it kills a job's daemons (``launcher/stackagent.py``), so a
killed job's leftovers are gone before the next job there; ``dtrun doctor`` lists what is
left on each host (``checks/remote_probe.py`` runs this module).
"""
import os
import re
import shutil

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_+-]{0,63}\.([0-9]{1,10})$")
_RENDEZVOUS_PREFIX = "pmix."
MAX_ENTRIES = 20000  # a /tmp larger than this is not scanned (the sweep must stay cheap)


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


def stale(top: str, uid=None) -> list:
    """Paths of the session directories in ``top`` whose process is gone (see the module doc)."""
    uid = os.getuid() if uid is None else uid
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
                    found.append(entry.path)
    except OSError:
        return []
    return found


def sweep(environ=None) -> list:
    """Remove this host's stale session directories; the paths removed (never raises)."""
    removed = []
    for path in stale(top_dir(environ)):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed
