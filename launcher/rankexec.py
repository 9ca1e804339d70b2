"""The wrapper every rank runs under (the remote side of the launcher; standard library only).

``python -S rankexec.py -- PROGRAM ARGS...`` runs on each rank, before the user's program:

* exports DTRUN_RANK, DTRUN_LOCAL_RANK, DTRUN_SIZE, DTRUN_LOCAL_SIZE derived from the
  MPI flavor's own variables (Open MPI's OMPI_COMM_WORLD_*, Hydra's PMI_* / MPI_LOCAL*);
* runs a Python program of the same environment as ``python -m mpi4py ...`` so an
  uncaught exception calls MPI_Abort and stops the whole job instead of leaving the
  other ranks blocked in a collective (what ``python -m mpi4py`` documents);
* with DTRUN_LOG_DIR set, sends the rank's stdout and stderr to DIR/rank.N.log;
* when the program fails, prints one marker line on stderr that dtrun reads to
  name the first failing rank, its host and its exit code or signal.

It stays the parent of the program so it can report how it ended; the program gets
PR_SET_PDEATHSIG so it never outlives the wrapper when MPI kills the job.
"""
import os
import re
import signal
import socket
import subprocess
import sys

MARKER = "dtrun-rank-exit:"
_RANK_VARS = (
    # (rank, local rank, size, local size) per flavor, first match wins
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
    ("PMIX_RANK", "PMIX_LOCAL_RANK", "PMIX_SIZE", "PMIX_LOCAL_SIZE"),
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"),
)
_PY_FLAGS_NOARG = set("bBdEhiIOqsSuvx")
_PY_FLAGS_ARG = {"-W", "-X", "--check-hash-based-pycs"}


def rank_env(environ):
    """DTRUN_* variables derived from the flavor's own per-rank variables."""
    for names in _RANK_VARS:
        if names[0] in environ:
            values = [environ.get(n, "") for n in names]
            return dict(zip(("DTRUN_RANK", "DTRUN_LOCAL_RANK", "DTRUN_SIZE", "DTRUN_LOCAL_SIZE"), values))
    return {"DTRUN_RANK": "0", "DTRUN_LOCAL_RANK": "0", "DTRUN_SIZE": "1", "DTRUN_LOCAL_SIZE": "1"}


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


def _pdeathsig():
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.stderr.write("rankexec: no program given\n")
        return 2
    env = dict(os.environ)
    env.update(rank_env(env))
    rank = env["DTRUN_RANK"]
    host = socket.gethostname()
    prog = with_abort_on_exception(argv)
    stdout = stderr = log_path = None
    log_dir = env.get("DTRUN_LOG_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        log_path = os.path.join(log_dir, f"rank.{rank}.log")
        stdout = open(log_path, "ab", buffering=0)
        stderr = subprocess.STDOUT
    # Hang diagnosis (launcher/rankstate.py): state file + faulthandler armed in the program.
    job_dir = env.get("DTRUN_JOB_DIR")
    if job_dir:
        import rankstate
        if rankstate.prepare(job_dir):
            prog = rankstate.with_stack_dump(prog, job_dir, rank, env)
        else:
            job_dir = None
    # Hydra hands each rank its PMI socket as an inherited descriptor (PMI_FD); closing it
    # makes MPI_Init fail ("PMI_Get_appnum returned -1" under MPICH). Only that one is kept.
    pmi_fd = env.get("PMI_FD", "")
    try:
        child = subprocess.Popen(prog, env=env, stdout=stdout, stderr=stderr, preexec_fn=_pdeathsig,
                                 pass_fds=(int(pmi_fd),) if pmi_fd.isdigit() else ())
    except OSError as exc:
        # The shell's convention: 127 for a command that is not there, 126 for one that cannot run.
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        why = "command not found" if code == 127 else (exc.strerror or "cannot run").lower()
        name = argv[0].replace("\n", " ")
        sys.stderr.write(f"{MARKER} rank={rank} host={host} code={code} start-error={why}; program={name}\n")
        return code
    if job_dir:
        rankstate.write_state(job_dir, rank, host, child.pid, argv, log_path)

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, forward)
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:
            continue
    if job_dir:
        rankstate.cleanup(job_dir, rank)
    if rc < 0:
        sys.stderr.write(f"{MARKER} rank={rank} host={host} signal={-rc}\n")
        sys.stderr.flush()
        return 128 - rc
    if rc != 0:
        sys.stderr.write(f"{MARKER} rank={rank} host={host} code={rc}\n")
        sys.stderr.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
