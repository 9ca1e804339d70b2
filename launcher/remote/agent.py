"""The far side of `dtrun stacks` and `--hang-timeout`: runs on one host, standard library only.

``python3 -S agent.py dump JOB_DIR [TIMEOUT [faulthandler]]`` prints one JSON object describing every
rank of the job on this host (the ``rank.N.json`` files the rank wrapper wrote whose host
is this one): pid, process state and wchan from /proc, every thread's Python stack, the
flight recorder of the collectives runtime, and for non-Python ranks a native stack.

Stacks come from, in order: ``py-spy dump`` when it is installed (reads the process from
outside, no cooperation needed); the faulthandler the rank wrapper armed (a C-level signal
handler, so it answers even inside a blocking MPI call); ``gdb`` for ranks that are not
Python. Every step has a timeout; the ranks are asked in parallel.

``python3 -S agent.py watch JOB_DIR INTERVAL`` prints one JSON line per interval with
each local rank's progress (recorder sequence, log size), until its output is closed.

``python3 -S agent.py sample JOB_DIR WINDOW [RATE [VIA]]`` prints one JSON line per window
with how each local rank spends its time (launcher/remote/waitsampler.py): the straggler finding
and `dtrun top` read it.

``python3 -S agent.py kill JOB_DIR`` sends SIGKILL to every rank of the job on this host, and
to the MPI daemons that started them if they are still alive (rankstate.record_daemon), then
removes the session directories those daemons leave (launcher/remote/sessiondirs.py), and what the
ranks left in the job directory (``tidy``). ``python3 -S agent.py reap JOB_DIR SECONDS NSPACE``
does the same after an Open MPI 5 job ended by itself, for a daemon PMIx deadlocked in its
finalize, which it finds by the job's namespace and gives a second to exit by itself.

``python3 -S agent.py notice JOB_DIR SECONDS TIMESTAMP added|removed`` posts dtrun's notice of a
change of hosts (launcher/elastic.py) in the job directory on this host, where rank 0 reads it.

``python3 -S agent.py forget JOB_DIR SECONDS RUN_ID`` removes this host's ``hvd.elastic`` commits
of a run that is over (dtrun/commitstore.py), when its directories are this user's own.

``python3 -S agent.py tidy JOB_DIR`` removes what the job's ended ranks left in the job
directory on this host (rankstate.tidy): after a failed job, on a host that does not share it.

The job directory is written by the ranks' own programs too, so a pid found there is only
examined or signalled once rankstate.job_process proved it is this job's process; and a
dump request goes only to a rank that handles the signal at that moment (``pystacks.not_handling``).
Its flight recorder is read only from a regular file of the recorder's size, with pread
(``rankstate.read_recorder``): a FIFO, a link or a truncated file there is named for that rank.
"""
import sys

if __name__ == "__main__":  # started as a script, or shipped as one program (bundle)
    if "launcher.remote" not in sys.modules:
        import os
        sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import launcher.remote  # noqa: F401 (the package of its siblings, in this process only)
    __package__ = "launcher.remote"  # PEP 366: the relative imports below find the siblings

import json
import os
import signal
import socket
import threading
import time

from dtrun import recorderfile

from . import procfs, rankstate, sessiondirs, waitsampler
from .procfs import proc_info
from .pystacks import faulthandler_stacks, gdb_stacks, pyspy_stacks, source_line

REC_SHOWN = 8  # newest recorder entries put in a report


def read_recorder(job_dir, rank):
    """The pid and newest entries (``REC_SHOWN``) of a rank's recorder, or None."""
    return recorder_entries(job_dir, rank)[0]


def recorder_entries(job_dir, rank):
    """(read_recorder's answer, why the rank's recorder file was not read or None)."""
    words, why = rankstate.read_recorder(job_dir, rank)
    rec = None if words is None else recorderfile.decode(words)
    return (None if rec is None else {"pid": rec["pid"], "entries": rec["entries"][-REC_SHOWN:]}), why


def recorder_seq(job_dir, rank):
    """The newest sequence number in a rank's recorder, reading only the ring (cheap)."""
    words = rankstate.recorder_words(job_dir, rank)
    return None if words is None else recorderfile.newest_seq(words)


def _python_stacks(job_dir, rank, pid, timeout, via, out):
    """A Python rank's threads from py-spy, else its faulthandler: (threads, errors), the
    source in ``out["source"]``. When py-spy timed out and faulthandler cannot answer (the
    rank does not catch the signal now), py-spy is asked once more without pausing the rank."""
    errors = []
    threads, err = (None, "py-spy not asked") if via == "faulthandler" else pyspy_stacks(pid, timeout)
    out["source"] = "py-spy"
    if threads is None:
        errors.append(err)
        threads, err = faulthandler_stacks(job_dir, rank, pid, timeout)
        out["source"] = "faulthandler"
        if threads is None:
            errors.append(err)
    if threads is None and via != "faulthandler" and "no answer" in (errors[0] or ""):
        threads, err = pyspy_stacks(pid, timeout, nonblocking=True)
        out["source"] = "py-spy"
        if threads is None:
            errors.append(err)
    return threads, errors


def _full_paths(threads, pid):
    """Relative frame paths made absolute against the rank's cwd, and their source lines."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        cwd = None
    for t in threads:
        for fr in t["frames"]:
            f = fr.get("file", "")
            if cwd and f and not f.startswith(("/", "<")) and os.path.exists(os.path.join(cwd, f)):
                fr["file"] = os.path.join(cwd, f)  # py-spy, faulthandler and gdb print paths as given
        for fr in t["frames"][:12]:
            if fr.get("line") and fr.get("file", "").startswith("/"):
                fr["code"] = source_line(fr["file"], fr["line"])


def describe_rank(job_dir, st, timeout, via="auto"):
    pid = st.get("pid")
    out = {"rank": st["rank"], "host": st["host"], "pid": pid, "argv": st.get("argv", [])}
    refusal = rankstate.job_process(job_dir, pid, st.get("start"))
    if refusal is not None:
        # Not this job's process (or no longer): not read, not attached to, not signalled.
        out["alive"] = False
        out["error"] = "process has exited" if refusal.exited else f"not examined: {refusal.why}"
        return out
    out.update(proc_info(pid))
    if not out["alive"]:
        out["error"] = "process has exited"
        return out
    python = "python" in out.get("exe", "") or os.path.exists(os.path.join(job_dir, f"rank.{st['rank']}.stack.armed"))
    if python:
        threads, errors = _python_stacks(job_dir, st["rank"], pid, timeout, via, out)
    else:
        threads, err = gdb_stacks(pid, timeout)
        out["source"], errors = "gdb", [err]
    if threads is None:
        out["source"] = None
        # The last answer is the one that decided (py-spy's failure led to faulthandler).
        out["error"] = "; ".join(e for e in reversed(errors) if e)
    else:
        _full_paths(threads, pid)
        out["threads"] = threads
    rec, why = recorder_entries(job_dir, st["rank"])
    if rec is not None and rec["pid"] == pid:
        out["recorder"] = rec["entries"]
    if why:  # the rank is described all the same; the full stacks file says what is wrong
        out["recorder_error"] = "flight recorder not read: " + why
        out["error"] = "; ".join(e for e in (out.get("error"), out["recorder_error"]) if e)
    return out


def dump(job_dir, timeout, via="auto"):
    ranks = rankstate.host_ranks(job_dir)
    results = [None] * len(ranks)

    def work(i, st):
        try:
            results[i] = describe_rank(job_dir, st, timeout, via)
        except Exception as exc:  # one rank's failure must not hide the others
            results[i] = {"rank": st.get("rank"), "host": st.get("host"), "pid": st.get("pid"),
                          "error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=work, args=(i, st), daemon=True) for i, st in enumerate(ranks)]
    for t in threads:
        t.start()
    limit = timeout * 3 + 5
    deadline = time.monotonic() + limit  # one deadline for all: a rank that is slow to read delays no other
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    late = {"error": f"no answer from the agent's reader within {limit:g} s"}
    return {"host": socket.gethostname(),
            "ranks": [r if r is not None else {"rank": st.get("rank"), "host": st.get("host"), "pid": st.get("pid"),
                                               **late} for r, st in zip(results, ranks)]}


def watch(job_dir, interval):
    while True:
        state = {}
        for st in rankstate.host_ranks(job_dir):
            log = st.get("log")
            try:
                size = os.path.getsize(log) if log else None
            except OSError:
                size = None
            state[str(st["rank"])] = [recorder_seq(job_dir, st["rank"]), size]
        try:
            sys.stdout.write(json.dumps({"host": socket.gethostname(), "ranks": state}) + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, OSError):
            return 0
        time.sleep(interval)


def _proven_ranks(job_dir):
    """(pids of this host's rank programs and wrappers proven to be this job's, refusals)."""
    ranks, refused = [], []
    for st in rankstate.host_ranks(job_dir):
        for pid_key, start_key in (("pid", "start"), ("wrapper_pid", "wrapper_start")):
            if st.get(pid_key) is None:
                continue
            refusal = rankstate.job_process(job_dir, st.get(pid_key), st.get(start_key))
            if refusal is None:
                ranks.append(st[pid_key])
            elif not refusal.exited:
                refused.append(f"rank {st['rank']}: {refusal.why}")
    return ranks, refused


def _proven_daemons(job_dir, ranks, nspace, host):
    """(pids of this host's MPI daemons proven to be this job's, refusals); their files are removed."""
    parents = {procfs.proc_parent(p) for p in ranks}
    found, refused = [], []
    try:
        names = [n for n in os.listdir(job_dir) if n.startswith("daemon.") and n.endswith(".json")]
    except OSError:
        names = []
    for name in names:
        path = os.path.join(job_dir, name)
        d = rankstate.read_json(path)
        if d is not None and d.get("host") != host:
            continue  # another host's daemon (a job directory on a shared file system)
        pid = procfs.valid_pid((d or {}).get("pid"))
        if pid is not None and (procfs.proc_start(pid) == (d.get("name"), d.get("start"))
                                and (pid in parents or rankstate.in_job(job_dir, pid, depth=1)
                                     or rankstate.started_by(pid, nspace))):
            found.append(pid)
        elif pid is not None and procfs.proc_start(pid) is not None:
            refused.append(f"daemon {pid}: not proven to be this job's")
        try:
            os.unlink(path)
        except OSError:
            pass
    return found, refused


def _nspace_daemons(nspace):
    """This user's Open MPI 5 daemons of the job whose PMIx namespace is ``nspace``, found in
    /proc: those no rank wrapper recorded (the wrapper's record is gone once the host's last
    rank ends, yet PMIx 5 can deadlock a prted in its own finalize after that, alive for good).
    Only a process whose name is a daemon's, owned by the user the agent runs as, in the
    agent's network namespace (this host's, where hosts share a kernel), with
    ``ess_base_nspace NSPACE`` on its command line (rankstate.started_by); dtrun passes the
    namespace after that job's mpirun has ended or been stopped."""
    if not nspace:
        return []
    me, found = os.getuid(), []
    try:
        names = os.listdir("/proc")
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or procfs.valid_pid(int(name)) is None or int(name) == os.getpid():
            continue
        pid = int(name)
        try:  # this host's: hosts that share one kernel (containers, namespaces) differ in network
            if os.stat(f"/proc/{pid}").st_uid != me or os.readlink(f"/proc/{pid}/ns/net") != net:
                continue
        except OSError:
            continue
        info = procfs.proc_start(pid)
        if info is not None and info[0] in rankstate.DAEMON_NAMES and rankstate.started_by(pid, nspace):
            found.append(pid)
    return found


# Seconds a daemon found only by its namespace gets to exit by itself after its job ended
# (``reap``): one still finalizing normally is not stuck, and is left to finish.
REAP_GRACE_S = 1.0


def kill(job_dir, nspace="", grace=0.0):
    """SIGKILL this host's ranks of the job, then the MPI daemons that started them and are
    still the same processes (an MPI daemon can outlive an mpirun that was killed).

    Only proven processes (rankstate.job_process): a rank's program can write any pid into
    its state file (-1 would be every process, another's pid an innocent process). A daemon
    has no job variable in its environment: it is proven as the parent of a proven rank
    wrapper (looked at before any rank is killed), by the job's variable where it has it, or
    (Open MPI 5) by ``nspace``, the job's PMIx namespace that dtrun passes on the command line:
    a daemon whose ranks have already ended has no rank left to prove it, and one whose
    record is gone (the host's last rank removed it) is found by that namespace in /proc;
    ``grace`` seconds let such a daemon exit by itself first (``reap``, after the job ended).
    Everything is proven first, then killed; pids are not re-read in between.
    """
    host = socket.gethostname()
    ranks, refused = _proven_ranks(job_dir)
    found, refused_daemons = _proven_daemons(job_dir, ranks, nspace, host)
    scanned = [pid for pid in _nspace_daemons(nspace) if pid not in found]
    if scanned and grace > 0:
        scanned = _wait_gone(scanned, grace, 0.05)
    found += scanned
    killed, daemons = [], []
    for pid in dict.fromkeys(ranks + found):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            if pid in found:
                daemons.append(pid)
        except OSError:
            pass
    swept = _sweep_after(daemons)
    _wait_gone(killed, 0.5, 0.02)  # a SIGKILLed rank is a zombie at once, or soon
    return {"host": host, "killed": killed, "daemons": daemons, "refused": refused + refused_daemons, "swept": swept,
            "tidied": rankstate.tidy(job_dir)}


def _wait_gone(pids, seconds, step):
    """Wait up to ``seconds`` for the processes ``pids`` are now (pid and start time) to end;
    returns those still there."""
    starts = {p: (procfs.proc_start(p) or (None, None))[1] for p in pids}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(procfs.gone(p, t) for p, t in starts.items()):
        time.sleep(step)
    return [p for p in pids if not procfs.gone(p, starts[p])]


def _sweep_after(daemons, wait_s=0.5):
    """Remove the session directories that the killed MPI daemons left (launcher/remote/sessiondirs.py),
    once they are gone (a killed process counts as alive until its parent reaps it)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(sessiondirs.alive(p) for p in daemons):
        time.sleep(0.02)
    return len(sessiondirs.sweep())


def main(argv):
    if len(argv) < 2 or argv[0] not in ("dump", "watch", "kill", "reap", "tidy", "sample", "notice", "forget"):
        sys.stderr.write("usage: agent.py dump|watch|kill|reap|tidy|sample|notice|forget JOB_DIR [SECONDS]\n")
        return 2
    mode, job_dir = argv[0], argv[1]
    seconds = float(argv[2]) if len(argv) > 2 else (2.0 if mode == "dump" else 1.0)
    if mode == "sample":
        rate = float(argv[3]) if len(argv) > 3 else 10.0
        via = argv[4] if len(argv) > 4 else "auto"  # "faulthandler" (no py-spy), "proc" (no stacks)
        return waitsampler.run(job_dir, seconds, rate, via, once="once" in argv[5:])
    if mode == "forget":
        from dtrun import commitstore  # lazy: only this mode needs it (its hashlib import is slow to start)
        forgot = len(argv) == 4 and commitstore.forget(argv[3])
        sys.stdout.write(json.dumps({"host": socket.gethostname(), "forgot": forgot}) + "\n")
        return 0
    if mode == "notice":
        posted = len(argv) == 5 and rankstate.post_notice(job_dir, argv[3], argv[4])
        sys.stdout.write(json.dumps({"host": socket.gethostname(), "posted": posted}) + "\n")
        return 0
    if mode == "watch":
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        return watch(job_dir, seconds)
    via = argv[3] if len(argv) > 3 else "auto"  # "faulthandler": do not use py-spy
    if mode == "tidy":
        result = {"host": socket.gethostname(), "tidied": rankstate.tidy(job_dir)}
    else:
        result = dump(job_dir, seconds, via) if mode == "dump" else \
            kill(job_dir, argv[3] if len(argv) > 3 else "", REAP_GRACE_S if mode == "reap" else 0.0)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
