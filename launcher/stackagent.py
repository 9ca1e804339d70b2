"""The far side of `dtrun stacks` and `--hang-timeout`: runs on one host, standard library only.

``python -S stackagent.py dump JOB_DIR [TIMEOUT [faulthandler]]`` prints one JSON object describing every
rank of the job on this host (the ``rank.N.json`` files the rank wrapper wrote whose host
is this one): pid, process state and wchan from /proc, every thread's Python stack, the
flight recorder of the collectives runtime, and for non-Python ranks a native stack.

Stacks come from, in order: ``py-spy dump`` when it is installed (reads the process from
outside, no cooperation needed); the faulthandler the rank wrapper armed (a C-level signal
handler, so it answers even inside a blocking MPI call); ``gdb`` for ranks that are not
Python. Every step has a timeout; the ranks are asked in parallel.

``python -S stackagent.py watch JOB_DIR INTERVAL`` prints one JSON line per interval with
each local rank's progress (recorder sequence, log size), until its output is closed.

``python -S stackagent.py sample JOB_DIR WINDOW [RATE [VIA]]`` prints one JSON line per window
with how each local rank spends its time (launcher/waitsampler.py): the straggler finding
and `dtrun top` read it.

``python -S stackagent.py kill JOB_DIR`` sends SIGKILL to every rank of the job on this host, and
to the MPI daemons that started them if they are still alive (rankstate.record_daemon), then
removes the session directories those daemons leave (launcher/sessiondirs.py), and what the
ranks left in the job directory (``tidy``).

``python -S stackagent.py tidy JOB_DIR`` removes what the job's ended ranks left in the job
directory on this host (rankstate.tidy): after a failed job, on a host that does not share it.

The job directory is written by the ranks' own programs too, so a pid found there is only
examined or signalled once rankstate.job_process proved it is this job's process; and a
dump request goes only to a rank that handles the signal at that moment (``signal_caught``).
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

# The flight recorder's file format (collectives/recorder.py; a test keeps both in step).
REC_MAGIC = 0x647472756E726563
REC_HEADER = 8
REC_OPS = ("", "allreduce", "reduce", "broadcast", "scatter", "gather", "allgather", "gatherv",
           "allgatherv", "reduce_scatter", "alltoall", "barrier", "grouped_allreduce")
REC_DTYPES = ("", "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
              "float16", "float32", "float64", "bfloat16", "complex64", "complex128")
REC_SHOWN = 8  # newest recorder entries put in a report
# From format version 2, header word REC_INSIDE is 1 while the rank is inside a blocking
# collective and 0 otherwise (launcher/waitsampler.py samples it for the waiting share).
REC_TIMED_VERSION = 2
REC_INSIDE = 5

_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_GDB_FRAME = re.compile(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(\S+) \(.*?\)(?: at (\S+):(\d+))?(?: from (\S+))?")


def _rankstate():
    try:
        import rankstate  # run as a script: launcher/ is sys.path[0]
    except ImportError:
        from launcher import rankstate
    return rankstate


def local_ranks(job_dir):
    host = socket.gethostname()
    out = []
    try:
        names = os.listdir(job_dir)
    except OSError:
        return out
    for name in names:
        if not (name.startswith("rank.") and name.endswith(".json")):
            continue
        st = _rankstate().read_json(os.path.join(job_dir, name))
        if st is not None and st.get("host") == host and type(st.get("rank")) is int and st["rank"] >= 0:
            out.append(st)  # the rank names files (rank.N.rec): a number, nothing else
    return sorted(out, key=lambda s: s["rank"])


def signal_caught(pid, signum):
    """Whether ``pid`` has a handler for ``signum`` now (SigCgt in /proc/PID/status, a hex
    mask with bit signum-1), False when it has none, None when that cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def signal_name(signum):
    rt = int(signal.SIGRTMIN)
    if rt <= signum <= int(signal.SIGRTMAX):
        return f"SIGRTMIN+{signum - rt}" if signum > rt else "SIGRTMIN"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def proc_info(pid):
    info = {"alive": os.path.exists(f"/proc/{pid}")}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    info["state"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/wchan") as f:
            w = f.read().strip()
            info["wchan"] = w if w and w != "0" else ""
    except OSError:
        pass
    try:
        info["exe"] = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        pass
    return info


def source_line(path, line):
    try:
        with open(path, errors="replace") as f:
            for i, text in enumerate(f, 1):
                if i == line:
                    return text.strip()[:160]
    except (OSError, ValueError):
        pass
    return ""


def _recorder_words(job_dir, rank):
    """A rank's recorder file as int64 words, or None when it is missing or not a recorder."""
    import array
    try:
        with open(os.path.join(job_dir, f"rank.{rank}.rec"), "rb") as f:
            raw = f.read()
    except OSError:
        return None
    words = array.array("q")
    words.frombytes(raw[: len(raw) - len(raw) % 8])
    if len(words) < REC_HEADER or words[0] != REC_MAGIC:
        return None
    return words


def read_recorder(job_dir, rank):
    words = _recorder_words(job_dir, rank)
    if words is None:
        return None
    entries = []
    for i in range(words[4]):
        j = REC_HEADER + 2 * i
        if j + 1 >= len(words):
            break
        seq, desc = words[j], words[j + 1]
        if seq <= 0:
            continue
        op, dt, root = (desc >> 58) & 0x1F, (desc >> 52) & 0x3F, ((desc >> 36) & 0xFFFF) - 1
        entries.append({"seq": seq, "op": REC_OPS[op] if op < len(REC_OPS) else str(op),
                        "dtype": REC_DTYPES[dt] if dt < len(REC_DTYPES) else str(dt),
                        "count": desc & ((1 << 36) - 1), "root": root if root >= 0 else None})
    entries.sort(key=lambda e: e["seq"])
    return {"pid": words[2], "entries": entries[-REC_SHOWN:]}


def recorder_seq(job_dir, rank):
    """The newest sequence number in a rank's recorder, reading only the ring (cheap)."""
    words = _recorder_words(job_dir, rank)
    return None if words is None else max(words[REC_HEADER::2], default=0)


def _pyspy():
    found = shutil.which("py-spy")
    if found:
        return found
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else None


def pyspy_stacks(pid, timeout):
    exe = _pyspy()
    if not exe:
        return None, "py-spy not installed"
    try:
        p = subprocess.run([exe, "dump", "--json", "--pid", str(pid)], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"py-spy gave no answer within {timeout:g} s"
    except OSError as exc:
        return None, f"py-spy: {exc.strerror}"
    if p.returncode != 0:
        lines = [line.strip() for line in p.stderr.splitlines() if line.strip()]
        # py-spy prints "Error: ..." and then, in some builds, a backtrace of its own.
        why = next((line for line in lines if line.startswith("Error:")), lines[-1] if lines else "failed")
        return None, "py-spy: " + why[:200]
    try:
        data = json.loads(p.stdout)
    except ValueError:
        return None, "py-spy: unreadable output"
    threads = []
    for t in data:
        frames = [{"func": fr.get("name", "?"), "file": fr.get("filename", "?"), "line": fr.get("line", 0)}
                  for fr in t.get("frames", [])]
        threads.append({"name": t.get("thread_name") or f"Thread {t.get('os_thread_id')}",
                        "main": t.get("os_thread_id") == pid, "frames": frames})
    return threads, None


def parse_faulthandler(text):
    """faulthandler's dump → threads, innermost frame first (as it prints them)."""
    threads, cur = [], None
    for line in text.splitlines():
        m = _FH_THREAD.match(line)
        if m:
            cur = {"name": f"Thread {m.group(2)}", "main": False, "current": m.group(1) == "Current thread",
                   "frames": []}
            threads.append(cur)
            continue
        m = _FH_FRAME.match(line)
        if m and cur is not None:
            cur["frames"].append({"func": m.group(3), "file": m.group(1), "line": int(m.group(2))})
    # The main thread is the one whose outermost frame is the program's <module> / runpy.
    for t in threads:
        if t["frames"] and t["frames"][-1]["func"] == "<module>":
            t["main"] = True
    return threads


def faulthandler_stacks(job_dir, rank, pid, timeout):
    stack = os.path.join(job_dir, f"rank.{rank}.stack")
    try:
        with open(stack + ".armed") as f:
            armed_pid, signum = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return None, "faulthandler not armed (not a Python rank of dtrun's environment, or not started yet)"
    if armed_pid != pid:
        return None, "faulthandler armed by another process"
    try:
        start = os.path.getsize(stack)
    except OSError as exc:
        return None, f"no faulthandler file ({exc.strerror}): the rank is ending"
    # The .armed file outlives the handler: Python removes it while shutting down (a rank
    # waiting in MPI_Finalize) and a program may unregister it, and then the signal's default
    # action would kill the rank. So the handler is looked up right before the signal is sent.
    # It can still be removed in between: the rank wrapper's boot code makes "ignore" what
    # faulthandler leaves behind (rankstate.BOOT), so such a late request is dropped, not fatal.
    caught = signal_caught(pid, signum)
    if not caught:
        why = ("Python is shutting down, or the program closed faulthandler" if caught is False
               else "its signal handlers cannot be read")
        return None, f"the rank is not handling {signal_name(signum)} now ({why})"
    try:
        os.kill(pid, signum)
    except OSError as exc:
        return None, f"cannot signal pid {pid}: {exc.strerror}"
    deadline, size, stable = time.monotonic() + timeout, start, 0
    try:
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = os.path.getsize(stack)
            stable = stable + 1 if (now == size and now > start) else 0
            size = now
            if stable >= 3:
                break
        if size <= start:
            return None, f"faulthandler wrote nothing within {timeout:g} s"
        with open(stack, errors="replace") as f:
            f.seek(start)
            return parse_faulthandler(f.read()), None
    except OSError as exc:
        return None, f"its faulthandler file went away ({exc.strerror}): the rank ended"


def gdb_stacks(pid, timeout):
    gdb = shutil.which("gdb")
    if not gdb:
        return None, "gdb not installed"
    try:
        p = subprocess.run([gdb, "-nx", "-batch", "-p", str(pid), "-ex", "thread apply all bt"],
                           capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"gdb gave no answer within {timeout:g} s"
    threads, cur = [], None
    for line in p.stdout.splitlines():
        if line.startswith("Thread "):
            lwp = re.search(r"LWP (\d+)", line)
            cur = {"name": line.split("(")[0].strip(), "main": bool(lwp) and int(lwp.group(1)) == pid, "frames": []}
            threads.append(cur)
            continue
        m = _GDB_FRAME.match(line)
        if m:
            if cur is None:
                cur = {"name": "Thread 1", "main": True, "frames": []}
                threads.append(cur)
            func, path, line_no, lib = m.groups()
            cur["frames"].append({"func": func, "file": path or lib or "?", "line": int(line_no or 0)})
    return (threads, None) if threads else (None, "gdb: no stack (" + (p.stderr.strip().splitlines() or ["?"])[-1][:120] + ")")


def describe_rank(job_dir, st, timeout, via="auto"):
    pid = st.get("pid")
    out = {"rank": st["rank"], "host": st["host"], "pid": pid, "argv": st.get("argv", [])}
    refusal = _rankstate().job_process(job_dir, pid, st.get("start"))
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
    errors = []
    threads = None
    if python:
        threads, err = (None, "py-spy not asked") if via == "faulthandler" else pyspy_stacks(pid, timeout)
        out["source"] = "py-spy"
        if threads is None:
            errors.append(err)
            threads, err = faulthandler_stacks(job_dir, st["rank"], pid, timeout)
            out["source"] = "faulthandler"
            if threads is None:
                errors.append(err)
    else:
        threads, err = gdb_stacks(pid, timeout)
        out["source"] = "gdb"
        if threads is None:
            errors.append(err)
    if threads is None:
        out["source"] = None
        # The last answer is the one that decided (py-spy's failure led to faulthandler).
        out["error"] = "; ".join(e for e in reversed(errors) if e)
    else:
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
        out["threads"] = threads
    rec = read_recorder(job_dir, st["rank"])
    if rec is not None and rec["pid"] == pid:
        out["recorder"] = rec["entries"]
    return out


def dump(job_dir, timeout, via="auto"):
    ranks = local_ranks(job_dir)
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
    for t in threads:
        t.join(timeout * 3 + 5)
    return {"host": socket.gethostname(), "ranks": [r for r in results if r is not None]}


def watch(job_dir, interval):
    while True:
        state = {}
        for st in local_ranks(job_dir):
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


def kill(job_dir, nspace=""):
    """SIGKILL this host's ranks of the job, then the MPI daemons that started them and are
    still the same processes (an MPI daemon can outlive an mpirun that was killed).

    Only proven processes (rankstate.job_process): a rank's program can write any pid into
    its state file (-1 would be every process, another's pid an innocent process). A daemon
    has no job variable in its environment: it is proven as the parent of a proven rank
    wrapper (looked at before any rank is killed), by the job's variable where it has it, or
    (Open MPI 5) by ``nspace``, the job's PMIx namespace that dtrun passes on the command line:
    a daemon whose ranks have already ended has no rank left to prove it.
    Everything is proven first, then killed; pids are not re-read in between.
    """
    rs = _rankstate()
    host = socket.gethostname()
    ranks, refused = [], []
    for st in local_ranks(job_dir):
        for pid_key, start_key in (("pid", "start"), ("wrapper_pid", "wrapper_start")):
            if st.get(pid_key) is None:
                continue
            refusal = rs.job_process(job_dir, st.get(pid_key), st.get(start_key))
            if refusal is None:
                ranks.append(st[pid_key])
            elif not refusal.exited:
                refused.append(f"rank {st['rank']}: {refusal.why}")
    parents = {rs.proc_parent(p) for p in ranks}
    found = []
    try:
        names = [n for n in os.listdir(job_dir) if n.startswith("daemon.") and n.endswith(".json")]
    except OSError:
        names = []
    for name in names:
        path = os.path.join(job_dir, name)
        d = rs.read_json(path)
        if d is not None and d.get("host") != host:
            continue  # another host's daemon (a job directory on a shared file system)
        pid = rs.valid_pid((d or {}).get("pid"))
        if pid is not None and (rs.proc_start(pid) == (d.get("name"), d.get("start"))
                                and (pid in parents or rs.in_job(job_dir, pid, depth=1)
                                     or rs.started_by(pid, nspace))):
            found.append(pid)
        elif pid is not None and rs.proc_start(pid) is not None:
            refused.append(f"daemon {pid}: not proven to be this job's")
        try:
            os.unlink(path)
        except OSError:
            pass
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
    deadline = time.monotonic() + 0.5  # a SIGKILLed rank is a zombie at once, or soon
    starts = {p: (rs.proc_start(p) or (None, None))[1] for p in killed}
    while time.monotonic() < deadline and not all(rs.gone(p, s) for p, s in starts.items()):
        time.sleep(0.02)
    return {"host": host, "killed": killed, "refused": refused, "swept": swept, "tidied": rs.tidy(job_dir)}


def _sweep_after(daemons, wait_s=0.5):
    """Remove the session directories that the killed MPI daemons left (launcher/sessiondirs.py),
    once they are gone (a killed process counts as alive until its parent reaps it)."""
    try:
        import sessiondirs  # run as a script: launcher/ is sys.path[0]
    except ImportError:
        from launcher import sessiondirs
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(sessiondirs.alive(p) for p in daemons):
        time.sleep(0.02)
    return len(sessiondirs.sweep())


def main(argv):
    if len(argv) < 2 or argv[0] not in ("dump", "watch", "kill", "tidy", "sample"):
        sys.stderr.write("usage: stackagent.py dump|watch|kill|tidy|sample JOB_DIR [SECONDS]\n")
        return 2
    mode, job_dir = argv[0], argv[1]
    seconds = float(argv[2]) if len(argv) > 2 else (2.0 if mode == "dump" else 1.0)
    if mode == "sample":
        try:
            import waitsampler  # run as a script: launcher/ is sys.path[0]
        except ImportError:
            from launcher import waitsampler
        rate = float(argv[3]) if len(argv) > 3 else 10.0
        via = argv[4] if len(argv) > 4 else "auto"  # "faulthandler" (no py-spy), "proc" (no stacks)
        return waitsampler.run(job_dir, seconds, rate, via, once="once" in argv[5:])
    if mode == "watch":
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        return watch(job_dir, seconds)
    via = argv[3] if len(argv) > 3 else "auto"  # "faulthandler": do not use py-spy
    if mode == "tidy":
        result = {"host": socket.gethostname(), "tidied": _rankstate().tidy(job_dir)}
    else:
        result = dump(job_dir, seconds, via) if mode == "dump" else kill(job_dir, argv[3] if len(argv) > 3 else "")
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
