"""A rank's stacks, read from outside: ``py-spy dump``, the faulthandler the rank wrapper armed
(launcher/remote/rankstate.py), or ``gdb`` for a rank that is not Python. Standard library only.

Each reader returns (threads, None) or (None, why): threads are
``{"name", "main", "frames": [{"func", "file", "line"}]}``. A faulthandler request is sent
only to a rank of this job that handles the signal at that moment (``procfs.signal_caught``).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from launcher.remote.procfs import signal_caught

_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_GDB_FRAME = re.compile(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(\S+) \(.*?\)(?: at (\S+):(\d+))?(?: from (\S+))?")


def signal_name(signum):
    rt = int(signal.SIGRTMIN)
    if rt <= signum <= int(signal.SIGRTMAX):
        return f"SIGRTMIN+{signum - rt}" if signum > rt else "SIGRTMIN"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def source_line(path, line):
    try:
        with open(path, errors="replace") as f:
            for i, text in enumerate(f, 1):
                if i == line:
                    return text.strip()[:160]
    except (OSError, ValueError):
        pass
    return ""


def pyspy_path():
    found = shutil.which("py-spy")
    if found:
        return found
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else None


def pyspy_stacks(pid, timeout):
    exe = pyspy_path()
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
