"""What each rank leaves in the job directory so dtrun can find it while it runs.

Runs inside the rank wrapper (launcher/remote/rankexec.py) on every host: standard library only.

For rank N the wrapper writes, under the job directory (``$DTRUN_JOB_DIR``, the same path
on every host, local to each host):

* ``rank.N.json``: rank, host, the program's pid and the wrapper's with their start times,
  the program, the log file; read by ``launcher/remote/agent.py`` to know which processes to
  look at;
* ``daemon.PID.json``: the MPI daemon that started the wrapper on this host (prted, orted,
  hydra_pmi_proxy) with its start time, so that dtrun can stop a daemon that outlived a
  job it stopped (``agent.py kill``); the last rank of the job on this host to end
  removes it (one per daemon), and with it the job directory when nothing else is left
  there (a host without a shared file system keeps nothing of the job);
* ``rank.N.stack``: where Python's faulthandler writes every thread's stack when the rank
  receives ``dump_signal()``; ``rank.N.stack.armed`` says it is listening ("PID SIGNUM").

faulthandler is armed by a few lines run before the program (``BOOT``), ahead of
``-m mpi4py``: its handler is C code, so it dumps even while the rank is blocked inside
an MPI call, where a Python-level signal handler would never run. The signal is a
real-time one that MPI launchers do not use (Open MPI forwards SIGUSR1/SIGUSR2 to ranks,
Hydra sends SIGUSR1 to ranks when a peer fails); it is sent only to a process that wrote
its ``.armed`` file and whose /proc status shows the signal caught at that moment, since a
real-time signal kills a process that does not handle it. Python removes faulthandler's
handler when it shuts down (a rank waiting in MPI_Finalize) and a program may unregister it:
BOOT sets the signal to "ignore" first, so that what faulthandler puts back is harmless.

Every file here can be rewritten by the rank's own program (same user), so nothing in it is
trusted to name a process: ``job_process`` proves a pid is this job's before dtrun touches it.
"""
import collections
import json
import os
import signal
import socket
import stat

from dtrun import recorderfile

from .procfs import gone, proc_parent, proc_start, valid_pid

# Offset from SIGRTMIN of the signal that makes a rank dump its stacks (SIGRTMIN+6).
DUMP_SIGNAL_OFFSET = 6

BOOT = (
    "import os, sys\n"
    "sys.path[0] = os.getcwd()\n"  # what `python -m mpi4py` would have put there
    "def _dtrun_arm():\n"
    "    path = os.environ.pop('DTRUN_STACK_FILE', None)\n"
    "    if not path:\n"
    "        return\n"
    "    try:\n"
    "        import faulthandler, signal\n"
    "        sig = signal.SIGRTMIN + %d\n"
    # What faulthandler restores when Python shuts down or the program unregisters it: a
    # dump request that comes then is dropped instead of killing the rank.
    "        signal.signal(sig, signal.SIG_IGN)\n"
    "        out = open(path, 'a')\n"
    "        faulthandler.register(sig, file=out, all_threads=True)\n"
    "        with open(path + '.armed', 'w') as f:\n"
    "            f.write('%%d %%d\\n' %% (os.getpid(), int(sig)))\n"
    "    except Exception:\n"
    "        pass\n"
    "_dtrun_arm()\n"
    "del _dtrun_arm\n"
    "if sys.argv[1:3] == ['-m', 'mpi4py']:\n"  # kept on the command line for ps and tools
    "    del sys.argv[1:3]\n"
    "import runpy\n"
    "runpy.run_module('mpi4py', run_name='__main__', alter_sys=True)\n"
) % DUMP_SIGNAL_OFFSET


def dump_signal():
    return int(signal.SIGRTMIN) + DUMP_SIGNAL_OFFSET


def paths(job_dir, rank):
    base = os.path.join(job_dir, f"rank.{rank}")
    return {"state": base + ".json", "stack": base + ".stack", "armed": base + ".stack.armed",
            "rec": base + ".rec"}


def with_stack_dump(prog, job_dir, rank, env):
    """``python ... -m mpi4py REST`` → ``python ... -c BOOT -m mpi4py REST`` with the dump file in env.

    BOOT drops the ``-m mpi4py`` it finds in sys.argv; it stays in the command line so that
    ps (and tools that look for it) still show what runs.

    Programs that do not run under ``-m mpi4py`` (not Python, another Python) are
    returned unchanged: py-spy, gdb and /proc still describe them.
    """
    for i in range(1, len(prog) - 1):
        if prog[i] == "-m" and prog[i + 1] == "mpi4py":
            env["DTRUN_STACK_FILE"] = paths(job_dir, rank)["stack"]
            return prog[:i] + ["-c", BOOT] + prog[i:]
    return prog


def write_state(job_dir, rank, host, pid, argv, log_path=None):
    """Write rank.N.json atomically (a reader never sees half a file), with the start times
    that tell the program and this wrapper from later processes given the same pids."""
    p = paths(job_dir, rank)["state"]
    tmp = f"{p}.{os.getpid()}.tmp"
    state = {"rank": int(rank) if str(rank).isdigit() else rank, "host": host, "pid": pid,
             "start": (proc_start(pid) or (None, None))[1], "wrapper_pid": os.getpid(),
             "wrapper_start": (proc_start(os.getpid()) or (None, None))[1], "argv": list(argv)[:8],
             "log": log_path}
    try:
        prepare(job_dir)  # another rank of this host that ended may have removed the empty directory
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, p)
        live = _live_dir(job_dir, host)
        os.makedirs(live, mode=0o700, exist_ok=True)
        open(os.path.join(live, str(rank)), "w").close()
    except OSError:
        pass  # diagnosis is best effort; the job runs on


# Parents of a rank wrapper that are a launcher's per-host daemon (never sshd, slurmstepd or a shell).
DAEMON_NAMES = ("prted", "orted", "hydra_pmi_proxy")


# Every rank wrapper and rank program of a job carries its job directory in its environment
# (launcher/command.py): what tells the job's processes from any other on the host.
JOB_VAR = "DTRUN_JOB_DIR"


def in_job(job_dir, pid, depth=4):
    """Whether ``pid``, or one of its ``depth - 1`` nearest ancestors, was started with this
    job's directory in its environment (/proc/PID/environ: the environment it was started
    with, which later changes in the process do not alter)."""
    want, prefix = os.path.normpath(job_dir), f"{JOB_VAR}=".encode()
    for _ in range(depth):
        if valid_pid(pid) is None:
            return False
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                for entry in f.read().split(b"\0"):
                    if entry.startswith(prefix) and os.path.normpath(os.fsdecode(entry[len(prefix):])) == want:
                        return True
        except OSError:
            pass
        pid = proc_parent(pid)
    return False


def started_by(pid, nspace):
    """Whether ``pid`` is an Open MPI 5 daemon of the job whose PMIx namespace is ``nspace``
    (``prterun-HOST-PID@0``: the launching host's name and its mpirun's pid, which dtrun passes
    to the kill agent itself; a rank cannot forge it). PRRTE gives every prted it starts
    ``--prtemca ess_base_nspace NSPACE`` on its command line."""
    if not nspace or valid_pid(pid) is None:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    want = nspace.encode()  # the daemon ssh starts has it in double quotes, the one it forks not
    return any(a == b"ess_base_nspace" and i + 1 < len(args) and args[i + 1] in (want, b'"' + want + b'"')
               for i, a in enumerate(args))


# Why a pid from the job directory is not acted on; ``exited``: it names no process now.
Refusal = collections.namedtuple("Refusal", "why exited")


def job_process(job_dir, pid, start):
    """None when ``pid`` is proven to be a live process of this job, else a Refusal (a rank's
    program can rewrite its state file with any pid: dtrun signals only what this proves).

    Proof: an ordinary pid, the start time the wrapper recorded for it (not a later process
    given the same pid), and the job's directory in its environment or its parents'.
    """
    if valid_pid(pid) is None:
        return Refusal(f"pid {pid!r} is not one ordinary process", False)
    info = proc_start(pid)
    if info is None:
        return Refusal(f"pid {pid} has exited", True)
    if type(start) is not int or info[1] != start:
        return Refusal(f"pid {pid} is not the process recorded (its start time differs)", False)
    if not in_job(job_dir, pid):
        return Refusal(f"pid {pid} is not a process of this job ({JOB_VAR} is not in its environment)", False)
    return None


def record_daemon(job_dir, host, pid):
    """Remember the MPI daemon ``pid`` (the wrapper's parent) when it is one (see DAEMON_NAMES)."""
    info = proc_start(pid)
    if info is None or info[0] not in DAEMON_NAMES:
        return
    p = os.path.join(job_dir, f"daemon.{pid}.json")
    tmp = f"{p}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"host": host, "pid": pid, "name": info[0], "start": info[1]}, f)
        os.replace(tmp, p)
    except OSError:
        pass


def prepare(job_dir):
    """Create the job directory on this host; False if it cannot be (never fails the job)."""
    try:
        os.makedirs(job_dir, mode=0o700, exist_ok=True)
        return True
    except OSError:
        return False


def cleanup(job_dir, rank):
    """Remove this rank's files when it ends; the last rank of the job on this host also
    removes the host's daemon files and the job directory if nothing else is left in it."""
    host = socket.gethostname()
    _remove_rank(job_dir, rank, host)
    _after_last_rank(job_dir, host)


def _host_files(job_dir):
    """(N, state) for each ``rank.N.json`` of the job directory written on this host: only
    files named by a number, since the number builds the paths that are read and removed."""
    host = socket.gethostname()
    try:
        names = os.listdir(job_dir)
    except OSError:
        return []
    out = []
    for name in names:
        rank = name[len("rank."):-len(".json")] if name.startswith("rank.") and name.endswith(".json") else ""
        st = read_json(os.path.join(job_dir, name)) if rank.isdigit() else None
        if st is not None and st.get("host") == host:
            out.append((rank, st))
    return out


def host_ranks(job_dir):
    """The state of every rank of the job on this host, by rank number."""
    out = [st for _, st in _host_files(job_dir) if type(st.get("rank")) is int and st["rank"] >= 0]
    return sorted(out, key=lambda s: s["rank"])  # the rank names files (rank.N.rec): a number, nothing else


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def _not_a_recorder(info):
    """Why a file (its stat) is not one the agent reads as a recorder, or None."""
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        return f"is {kind}, not a regular file"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_size != recorderfile.NBYTES:
        return f"has {info.st_size} bytes, not a recorder's {recorderfile.NBYTES} (truncated or replaced)"
    return None


def open_recorder(job_dir, rank):
    """A rank's flight recorder file opened for reading: (fd, None); (None, None) when there is
    none; (None, why) when what is there is not read. The rank's program can put anything at
    that path: a link is not followed, a FIFO not waited on, a device never opened; only a
    regular file of this user with the recorder's exact size is (checked on the open file)."""
    name = recorderfile.file_name(rank)
    path = os.path.join(job_dir, name)
    try:
        why = _not_a_recorder(os.lstat(path))
        if why is None:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            why = _not_a_recorder(os.fstat(fd))  # it may have been replaced since lstat
            if why is None:
                return fd, None
            os.close(fd)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        why = f"cannot be opened ({exc.strerror})"
    return None, f"{name} {why}"


def read_recorder(job_dir, rank):
    """(a rank's flight recorder as int64 words, None), (None, None) when it has none, or
    (None, why) when its file is not read (``open_recorder``) or not a recorder. Reads at most
    recorderfile.NBYTES with pread, never a mapping: a file that shrinks under the reader is a finding,
    not a SIGBUS."""
    import array
    fd, why = open_recorder(job_dir, rank)
    if fd is None:
        return None, why
    try:
        raw = os.pread(fd, recorderfile.NBYTES, 0)
    except OSError as exc:
        return None, f"{recorderfile.file_name(rank)} cannot be read ({exc.strerror})"
    finally:
        os.close(fd)
    if len(raw) < recorderfile.NBYTES:
        return None, f"{recorderfile.file_name(rank)} was truncated to {len(raw)} bytes while read"
    words = array.array("q")
    words.frombytes(raw)
    if words[0] != recorderfile.MAGIC:
        return None, f"{recorderfile.file_name(rank)} is not a flight recorder (no magic word)"
    return words, None


def recorder_words(job_dir, rank):
    """A rank's flight recorder file as int64 words, or None when it is missing or not read."""
    return read_recorder(job_dir, rank)[0]


def tidy(job_dir):
    """What the wrappers of this host could not remove (a wrapper that was SIGKILLed, after a
    failed or stopped job): the files of every rank of this host whose program and wrapper
    have both ended, then, if no rank of this host is left, the host's daemon files and the
    job directory when empty. Returns the ranks whose files were removed."""
    host = socket.gethostname()
    if not os.path.isdir(job_dir):
        return []
    removed, kept = [], False
    for rank, st in _host_files(job_dir):
        if gone(st.get("pid"), st.get("start")) and gone(st.get("wrapper_pid"), st.get("wrapper_start")):
            _remove_rank(job_dir, rank, host)
            removed.append(int(rank))
        else:
            kept = True
    if not kept:
        _after_last_rank(job_dir, host)
    return sorted(removed)


def read_json(path):
    """A JSON object from a regular file, never through a link nor from a FIFO (the rank's
    program can put anything in the job directory), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd) as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > 1 << 20:
                return None
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _remove_rank(job_dir, rank, host):
    for p in paths(job_dir, rank).values():
        try:
            os.unlink(p)
        except OSError:
            pass
    try:
        os.unlink(os.path.join(_live_dir(job_dir, host), str(rank)))
    except OSError:
        pass


def _after_last_rank(job_dir, host):
    """Once no rank of this host is listed, remove the host's daemon files and the job
    directory if it is empty. rmdir of the list succeeds for one caller only, once it is
    empty: that one is the last. A rank that starts on this host after that (a program that
    ended before another rank was launched) makes the list anew and tidies up in turn."""
    try:
        os.rmdir(_live_dir(job_dir, host))
    except FileNotFoundError:
        pass  # no rank of this host listed (or another caller is tidying): daemon files may remain
    except OSError:
        return
    try:
        names = os.listdir(job_dir)
    except OSError:
        return
    for name in names:
        if not (name.startswith("daemon.") and name.endswith(".json")):
            continue
        path = os.path.join(job_dir, name)
        d = read_json(path)
        if d is not None and d.get("host") != host:
            continue  # another host's, on a shared file system
        try:
            os.unlink(path)
        except OSError:
            pass
    try:
        os.unlink(os.path.join(job_dir, NOTICE))  # dtrun's notice of a change of hosts (post_notice)
    except OSError:
        pass
    try:
        os.rmdir(job_dir)  # only when empty: on dtrun's own host job.json keeps it
    except OSError:
        pass


NOTICE = "hosts.updated"  # launcher/elastic.py's and collectives/horovod/_elastic.py's


def post_notice(job_dir, timestamp, kind):
    """Write dtrun's notice of a change of hosts (``TIMESTAMP added|removed``) in the job
    directory on this host, whole or not at all; False when the values or the directory
    are not right (the directory is created private when rank 0 has not made it yet)."""
    if not (timestamp.isdigit() and len(timestamp) <= 18 and kind in ("added", "removed")):
        return False
    try:
        os.makedirs(job_dir, mode=0o700, exist_ok=True)
        st = os.lstat(job_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return False
        tmp = os.path.join(job_dir, ".%s.%s" % (NOTICE, os.urandom(6).hex()))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("%s %s\n" % (timestamp, kind))
        os.replace(tmp, os.path.join(job_dir, NOTICE))
        return True
    except OSError:
        return False


def _live_dir(job_dir, host):
    """The directory that lists this host's running ranks of the job (one empty file per rank)."""
    return os.path.join(job_dir, "live." + host.replace(os.sep, "_"))
