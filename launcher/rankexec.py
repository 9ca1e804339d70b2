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
)
_PY_FLAGS_NOARG = set("bBdEhiIOqsSuvx")
_PY_FLAGS_ARG = {"-W", "-X", "--check-hash-based-pycs"}


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
    stdout = stderr = None
    log_dir = env.get("DTRUN_LOG_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        stdout = open(os.path.join(log_dir, f"rank.{rank}.log"), "ab", buffering=0)
        stderr = subprocess.STDOUT
    try:
        # close_fds=False: the launcher hands ranks descriptors they need (PMI_FD of Hydra and of srun --mpi=pmi2).
        child = subprocess.Popen(prog, env=env, stdout=stdout, stderr=stderr, preexec_fn=_pdeathsig, close_fds=False)
    except OSError as exc:
        sys.stderr.write(f"{MARKER} rank={rank} host={host} code=127 error={exc.strerror}:{argv[0]}\n")
        return 127

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
