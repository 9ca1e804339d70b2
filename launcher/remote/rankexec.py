"""The wrapper every rank runs under (the remote side of the launcher; standard library only).

``python3 -S <repo>/launcher/remote/rankexec.py -- PROGRAM ARGS...`` runs on each rank, before
the user's program:

* exports DTRUN_RANK, DTRUN_LOCAL_RANK, DTRUN_SIZE, DTRUN_LOCAL_SIZE derived from the
  MPI flavor's own variables (Open MPI's OMPI_COMM_WORLD_*, Hydra's PMI_* / MPI_LOCAL*);
* exports torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE from the same
  values (dtrun sets MASTER_ADDR/MASTER_PORT at launch), so a script that calls
  ``init_process_group(init_method="env://")`` runs unchanged;
* with DTRUN_GPU_PER_RANK=1 (``dtrun --pin-gpus``), sets CUDA_VISIBLE_DEVICES to one GPU:
  the local rank modulo the GPUs visible (or present) on the host;
* runs a Python program of the same environment as ``python -m mpi4py ...`` so an
  uncaught exception calls MPI_Abort and stops the whole job instead of leaving the
  other ranks blocked in a collective (what ``python -m mpi4py`` documents);
* with DTRUN_LOG_DIR set, sends the rank's stdout and stderr to DIR/rank.N.log, a new
  file (mode 0600) in a directory of this user's that nobody else can write to (``open_log``);
* prints an end-of-output marker as its last line on stdout (dtrun then knows the
  rank's output arrived whole, or says it did not);
* prints a start marker on stderr as soon as it runs (dtrun's --start-timeout names
  the hosts whose ranks never printed one);
* when the program fails, prints one marker line on stderr that dtrun reads to
  name the first failing rank, its host and its exit code or signal, and whether
  the signal came from the launcher's tear-down (``forwarded=1``) or from elsewhere
  (``kill -9``, the OOM killer: the root cause of a failed job).

Every marker carries the job's random token (DTRUN_MARKER_TOKEN, made by dtrun for each
job and removed from the program's environment), so a program that prints a marker's
text itself (a test of dtrun, a log it shows) is passed through, never taken for one.

Every descriptor the launcher hands the rank stays open in the program (Hydra's
PMI_FD socket, PMIx's, any listed in the environment): ``MPI_Init`` needs them.

It stays the parent of the program so it can report how it ended; the program gets
PR_SET_PDEATHSIG so it never outlives the wrapper when MPI kills the job, and the
wrapper stops the program when its own parent (the MPI daemon) dies.
"""
import sys

if __name__ == "__main__":  # started as a script, or shipped as one program (bundle)
    if "launcher.remote" not in sys.modules:
        import os
        sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import launcher.remote  # noqa: F401 (the package of its siblings, in this process only)
    __package__ = "launcher.remote"  # PEP 366: the relative imports below find the siblings

import errno
import os
import re
import signal
import socket
import subprocess
import threading
import time

from . import wire
from .wire import MARKER_TOKEN_ENV, job_token
MARKER_LINGER_S = 0.3
OUTPUT_DRAIN_BPS = 20e6  # bytes a second assumed to leave through the launcher at the end
OUTPUT_LINGER_MAX_S = 3.0
_RANK_VARS = (
    # (rank, local rank, size, local size) per flavor, first match wins
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
    ("PMIX_RANK", "PMIX_LOCAL_RANK", "PMIX_SIZE", "PMIX_LOCAL_SIZE"),
)
_PY_FLAGS_NOARG = set("bBdEhiIOqsSuvx")
_PY_FLAGS_ARG = {"-W", "-X", "--check-hash-based-pycs"}


class LogError(Exception):
    """The rank's log cannot be created safely (the message says why)."""


def open_log(log_dir, rank):
    """Create ``log_dir/rank.N.log`` for writing (mode 0600) and return its descriptor.

    The run's directory is made here when this host lacks it (no shared file system),
    mode 0700. An existing one must be a real directory of this user's that no other user
    can write to; the file is created inside that very directory (opened without
    following links), and never reused (O_EXCL): a directory or a link planted by
    someone else in a shared place cannot make this rank write elsewhere.
    """
    parent = os.path.dirname(log_dir)
    try:
        if parent:
            os.makedirs(parent, mode=0o700, exist_ok=True)
        os.mkdir(log_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise LogError(f"cannot create {log_dir}: {exc.strerror}") from None
    try:
        dfd = os.open(log_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        why = "it is a symbolic link or not a directory" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
        raise LogError(f"cannot use {log_dir}: {why}") from None
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid():
            raise LogError(f"{log_dir} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                           "a run's log directory is always new and private")
        if st.st_mode & 0o022:
            raise LogError(f"{log_dir} is writable by other users (mode {st.st_mode & 0o777:o})")
        name = f"rank.{rank}.log"
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND | os.O_CLOEXEC,
                           0o600, dir_fd=dfd)
        except FileExistsError:
            raise LogError(f"{os.path.join(log_dir, name)} exists already (a link or a file: each run's logs are "
                           "new files)") from None
        except OSError as exc:
            raise LogError(f"cannot create {os.path.join(log_dir, name)}: {exc.strerror}") from None
    finally:
        os.close(dfd)


def _sweep_sessions():
    try:
        from . import sessiondirs  # lazy: Open MPI 5 jobs only; every rank's wrapper starts with this module
        sessiondirs.keep_daemon_dir(os.getppid())  # lock the daemon's own directory while it lives
        sessiondirs.sweep()
    except Exception:  # tidying must never disturb the rank
        pass


def _slurm_step_vars(environ):
    """(rank, local rank, size, local size) of a task srun started itself, or None.

    Under srun only part of a flavor's set is there (the pmi2 plugin sets PMI_RANK but no
    MPI_LOCALRANKID, pmix sets PMIX_RANK alone), so the step's own variables decide; the
    local size is this node's entry of SLURM_STEP_TASKS_PER_NODE ("2(x3),1").
    """
    try:
        counts = []
        for item in environ["SLURM_STEP_TASKS_PER_NODE"].split(","):
            n, _, rep = item.partition("(x")
            counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
        local_size = counts[int(environ["SLURM_NODEID"])]
        return (environ["SLURM_PROCID"], environ["SLURM_LOCALID"], environ["SLURM_STEP_NUM_TASKS"], str(local_size))
    except (KeyError, ValueError, IndexError):
        return None


def rank_env(environ):
    """DTRUN_* variables derived from the flavor's own per-rank variables.

    A flavor's set counts only when complete; then srun's step variables; else one rank.
    Open MPI's and Hydra's sets come first: when mpirun starts its daemons with srun, the
    ranks inherit SLURM_PROCID of a daemon, not their own.
    """
    keys = ("DTRUN_RANK", "DTRUN_LOCAL_RANK", "DTRUN_SIZE", "DTRUN_LOCAL_SIZE")
    for names in _RANK_VARS:
        if all(environ.get(n) for n in names):
            return dict(zip(keys, (environ[n] for n in names)))
    step = _slurm_step_vars(environ)
    if step is not None:
        return dict(zip(keys, step))
    for names in _RANK_VARS:  # an incomplete set still beats nothing for the rank itself
        if environ.get(names[0]):
            return dict(zip(keys, (environ.get(n) or d for n, d in zip(names, ("0", "0", "1", "1")))))
    return dict(zip(keys, ("0", "0", "1", "1")))


def torch_env(dtrun_env):
    """torchrun's names for the rank variables."""
    return {"RANK": dtrun_env["DTRUN_RANK"], "LOCAL_RANK": dtrun_env["DTRUN_LOCAL_RANK"],
            "WORLD_SIZE": dtrun_env["DTRUN_SIZE"], "LOCAL_WORLD_SIZE": dtrun_env["DTRUN_LOCAL_SIZE"]}


def pinned_gpu(environ, local_rank, dev_dir="/dev"):
    """The CUDA_VISIBLE_DEVICES value for this local rank: one of the GPUs already
    visible (an outer CUDA_VISIBLE_DEVICES list), else of /dev/nvidiaN, else the local
    rank itself (the driver's files may be hidden from this process)."""
    lr = int(local_rank) if str(local_rank).isdigit() else 0
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        return visible[lr % len(visible)]
    try:
        n = sum(1 for f in os.listdir(dev_dir) if re.fullmatch(r"nvidia[0-9]+", f))
    except OSError:
        n = 0
    return str(lr % n) if n else str(lr)


def _same_environment(prog):
    """True if ``prog`` is a Python of the environment this wrapper runs in (so mpi4py is there)."""
    if not re.match(r"^python[0-9.]*$", os.path.basename(prog)):
        return False
    path = prog if os.sep in prog else None
    if path is None:
        from shutil import which
        path = which(prog)
    return bool(path) and os.path.dirname(os.path.abspath(path)) == os.path.dirname(sys.executable)


def with_abort_on_exception(argv):
    """Rewrite ``python [opts] script|-m mod|-c cmd ...`` to run under ``-m mpi4py``.

    Interpreter options stay before ``-m mpi4py``; anything else is returned unchanged.
    """
    if not argv or not _same_environment(argv[0]):
        return argv
    i = 1
    while i < len(argv):
        a = argv[i]
        if a in _PY_FLAGS_ARG:
            i += 2
            continue
        if a.startswith("-W") or a.startswith("-X"):
            i += 1
            continue
        if a.startswith("-") and len(a) > 1 and a != "-" and not a.startswith("--") and set(a[1:]) <= _PY_FLAGS_NOARG:
            if "S" in a:
                return argv  # no site-packages, so no mpi4py to run under
            i += 1
            continue
        break
    if i >= len(argv):
        return argv  # interactive interpreter: nothing to wrap
    rest = argv[i:]
    if rest[:2] == ["-m", "mpi4py"]:
        return argv
    if rest[0] in ("-m", "-c") or not rest[0].startswith("-") or rest[0] == "-":
        return argv[:i] + ["-m", "mpi4py"] + rest
    return argv


def inherited_fds(environ):
    """Descriptors the launcher names in the environment (PMI_FD and any other *_FD) that are open."""
    fds = []
    for name, value in environ.items():
        if name.endswith("_FD") and value.isdigit() and int(value) > 2:
            try:
                os.fstat(int(value))
            except OSError:
                continue
            fds.append(int(value))
    return tuple(sorted(set(fds)))


def _bytes_written(pid):
    """Bytes the (exited, not yet reaped) program wrote, from /proc (0 where unknown)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _pdeathsig():
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _write(stream, text):
    stream.write(text)
    stream.flush()


def _never_ran(token, rank, host, code, why, program):
    """Report a program that could not start like one that failed: the end-of-output marker
    (nothing else will be written), then an exit marker naming the reason; dtrun names the host."""
    _write(sys.stdout, wire.eof_line(token, rank))
    _write(sys.stderr, wire.exit_line(token, rank, host, time.time(), code=code, start_error=why, program=program))
    time.sleep(MARKER_LINGER_S)
    return code


def _program_env():
    """The program's environment: the flavor's rank variables as DTRUN_* and torchrun's, the GPU pin."""
    env = dict(os.environ)
    env.update(rank_env(env))
    env.update(torch_env(env))
    if env.get("DTRUN_GPU_PER_RANK") == "1":
        env["CUDA_VISIBLE_DEVICES"] = pinned_gpu(env, env["DTRUN_LOCAL_RANK"])
    return env


def _supervise(child, env):
    """Forward the launcher's signals to the program and wait for it; stop it if the MPI daemon
    that started this wrapper dies. Returns (returncode, when it ended, signals forwarded, bytes written)."""
    forwarded = []

    def forward(signum, _frame):
        ended_by = _end_signal(child)
        if ended_by is not None and ended_by != signum:
            # The program had already ended (kill -9 from elsewhere, the OOM killer): the
            # tear-down's signal that came after did not stop it, so the marker must not say it
            # did. The same signal as the one that ended it is the launcher's, sent to the whole
            # process group (srun's slurmstepd, Open MPI 4), which reached the program first.
            return
        forwarded.append(signum)
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, forward)
    parent = os.getppid()
    orphaned_at = None
    exited = threading.Event()
    ended_at = []  # when the program ended: the markers' t=, not when they are written (after lingering)

    def watch():
        try:
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet
        except OSError:
            pass
        ended_at.append(time.time())
        exited.set()

    threading.Thread(target=watch, daemon=True).start()
    if env.get("DTRUN_LOCAL_RANK") == "0" and "PMIX_NAMESPACE" in env:
        # Open MPI: remove what killed jobs left on this host, so that no later daemon here
        # is refused for a pid a stale session directory names (launcher/remote/sessiondirs.py).
        threading.Thread(target=_sweep_sessions, daemon=True).start()
    while not exited.wait(1.0):
        # The launcher's daemon died (killed, OOM): stop the rank rather than leave it running.
        if orphaned_at is None and os.getppid() != parent:
            orphaned_at = time.monotonic()
            forward(signal.SIGTERM, None)
        elif orphaned_at is not None and time.monotonic() - orphaned_at > 3:
            forward(signal.SIGKILL, None)
    written = _bytes_written(child.pid)
    rc = child.wait()
    return rc, (ended_at[0] if ended_at else time.time()), forwarded, written


def _end_signal(child):
    """None while the program runs; once it has ended (reaped or not yet), the signal that
    ended it, or 0 when it exited."""
    if child.returncode is not None:
        return max(-child.returncode, 0)
    try:
        info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return 0
    if info is None:
        return None
    return info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else 0


def _report_end(rc, t_end, forwarded, written, logged, token, rank, host):
    """The end-of-output marker, then for a failed program its exit marker; the wrapper's exit code."""
    if not logged:
        # Open MPI forwards a remote rank's output through its daemon and was seen to drop what
        # was still on the way when the rank's exit ended the job: stay a moment longer after
        # a rank that wrote much (none after one that wrote little).
        time.sleep(min(OUTPUT_LINGER_MAX_S, written / OUTPUT_DRAIN_BPS))
    # The last line on stdout, after all of the program's own output: dtrun knows the rank's
    # output arrived whole when it sees this (Open MPI can drop the end of it when the job ends).
    try:
        _write(sys.stdout, wire.eof_line(token, rank))
    except OSError:
        pass
    if rc < 0 and not forwarded and -rc in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        # A launcher that signals every process of the step at once (srun's slurmstepd) can
        # reach the program a moment before this wrapper: give that signal time to arrive
        # (its handler runs during the sleep) before calling the death a kill from elsewhere.
        time.sleep(0.2)
    if rc < 0:
        # forwarded=1: the launcher was stopping this rank; 0: someone else killed it.
        _write(sys.stderr, wire.exit_line(token, rank, host, t_end, signum=-rc, forwarded=bool(forwarded)))
        return 128 - rc
    if rc != 0:
        # t=: when it ended, so dtrun can tell the first failure from the errors it caused elsewhere
        _write(sys.stderr, wire.exit_line(token, rank, host, t_end, code=rc))
        # Give the launcher a moment to forward the marker before it learns of this exit and
        # tears the job down (Hydra was seen to drop it otherwise).
        time.sleep(MARKER_LINGER_S)
    return rc


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.stderr.write("rankexec: no program given (usage: python3 -S rankexec.py -- PROGRAM [ARGS...])\n")
        return 2
    env = _program_env()
    rank, host = env["DTRUN_RANK"], socket.gethostname()
    token = job_token(env)
    env.pop(MARKER_TOKEN_ENV, None)  # the program has no use for it: its own output never carries it
    prog = with_abort_on_exception(argv)
    stdout = stderr = log_path = None
    log_dir = env.get("DTRUN_LOG_DIR")
    if log_dir:
        log_path = os.path.join(log_dir, f"rank.{rank}.log")
        try:
            stdout = open_log(log_dir, rank)
        except LogError as exc:
            # Reported like a program that cannot start: dtrun names the log, the reason and the host.
            _write(sys.stderr, wire.start_line(token, rank, host))
            return _never_ran(token, rank, host, 1, str(exc), "--log-dir")
        stderr = subprocess.STDOUT
    # Hang diagnosis (launcher/remote/rankstate.py): state file + faulthandler armed in the program.
    job_dir = env.get("DTRUN_JOB_DIR")
    if job_dir:
        from . import rankstate  # lazy: jobs with a job directory only; every rank's wrapper starts with this module
        if rankstate.prepare(job_dir):
            prog = rankstate.with_stack_dump(prog, job_dir, rank, env)
        else:
            job_dir = None
    _write(sys.stderr, wire.start_line(token, rank, host))
    # MPI launchers hand each rank inherited descriptors (Hydra's PMI socket in PMI_FD); closing
    # them makes MPI_Init fail ("PMI_Get_appnum returned -1" under MPICH). Those named by a
    # *_FD variable are kept; no others, so no stray descriptor (an ssh client's pipe under
    # Open MPI) outlives the job through the program.
    try:
        child = subprocess.Popen(prog, env=env, stdout=stdout, stderr=stderr, preexec_fn=_pdeathsig,
                                 pass_fds=inherited_fds(env))
    except OSError as exc:
        # The shell's convention: 127 for a command that is not there, 126 for one that cannot run.
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        why = "command not found" if code == 127 else (exc.strerror or "cannot run").lower()
        return _never_ran(token, rank, host, code, why, argv[0])
    if job_dir:
        rankstate.write_state(job_dir, rank, host, child.pid, argv, log_path)
        rankstate.record_daemon(job_dir, host, os.getppid())
    rc, t_end, forwarded, written = _supervise(child, env)
    if job_dir:
        rankstate.cleanup(job_dir, rank)
    return _report_end(rc, t_end, forwarded, written, bool(log_dir), token, rank, host)


if __name__ == "__main__":
    sys.exit(main())
