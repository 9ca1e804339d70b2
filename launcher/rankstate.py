"""What each rank leaves in the job directory so dtrun can find it while it runs.

Runs inside the rank wrapper (launcher/rankexec.py) on every host: standard library only.

For rank N the wrapper writes, under the job directory (``$DTRUN_JOB_DIR``, the same path
on every host, local to each host):

* ``rank.N.json``: rank, host, the program's pid and the wrapper's, the program, the log
  file; read by ``launcher/stackagent.py`` to know which processes to look at;
* ``daemon.PID.json``: the MPI daemon that started the wrapper on this host (prted, orted,
  hydra_pmi_proxy) with its start time, so that dtrun can stop a daemon that outlived a
  job it stopped (``stackagent.py kill``); the file stays until then (one per daemon);
* ``rank.N.stack``: where Python's faulthandler writes every thread's stack when the rank
  receives ``dump_signal()``; ``rank.N.stack.armed`` says it is listening ("PID SIGNUM").

faulthandler is armed by a few lines run before the program (``BOOT``), ahead of
``-m mpi4py``: its handler is C code, so it dumps even while the rank is blocked inside
an MPI call, where a Python-level signal handler would never run. The signal is a
real-time one that MPI launchers do not use (Open MPI forwards SIGUSR1/SIGUSR2 to ranks,
Hydra sends SIGUSR1 to ranks when a peer fails); it is sent only to a process that wrote
its ``.armed`` file, since a real-time signal kills a process that does not handle it.
"""
import json
import os
import signal

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
    """Write rank.N.json atomically (a reader never sees half a file)."""
    p = paths(job_dir, rank)["state"]
    tmp = f"{p}.{os.getpid()}.tmp"
    state = {"rank": int(rank) if str(rank).isdigit() else rank, "host": host, "pid": pid,
             "wrapper_pid": os.getpid(), "argv": list(argv)[:8], "log": log_path}
    try:
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, p)
    except OSError:
        pass  # diagnosis is best effort; the job runs on


# Parents of a rank wrapper that are a launcher's per-host daemon (never sshd, slurmstepd or a shell).
DAEMON_NAMES = ("prted", "orted", "hydra_pmi_proxy")


def proc_start(pid):
    """(name, start time in clock ticks) of a live process, or None: together they tell a
    process from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    name = stat[stat.find(b"(") + 1:stat.rfind(b")")].decode("utf-8", "replace")
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return name, int(fields[19])
    except (IndexError, ValueError):
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
    """Remove this rank's files when it ends."""
    for p in paths(job_dir, rank).values():
        try:
            os.unlink(p)
        except OSError:
            pass
