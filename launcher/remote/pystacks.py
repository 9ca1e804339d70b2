"""A rank's stacks, read from outside: ``py-spy dump``, the faulthandler the rank wrapper armed
(launcher/remote/rankstate.py), or ``gdb`` for a rank that is not Python. Standard library only.

Each reader returns (threads, None) or (None, why): threads are
``{"name", "main", "frames": [{"func", "file", "line"}]}``. A faulthandler request is sent
only to a rank of this job that handles the signal at that moment (``procfs.signal_disposition``).

Every file read here can be written by the rank's program (its faulthandler files, the source
files its frames name): ``read_file`` reads only regular files, never waits on a FIFO nor opens
a device, and reads a bounded amount.
"""
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

from .procfs import signal_disposition

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


SOURCE_LIMIT = 8 << 20  # bytes of a source file read for its lines
STACK_LIMIT = 4 << 20  # bytes of one faulthandler dump read


def read_file(path, limit, start=0, follow=True):
    """Up to ``limit`` bytes of the regular file ``path`` from offset ``start``, as text; OSError
    or ValueError for anything else (a FIFO, a device, a directory; a link unless ``follow``)."""
    if not stat.S_ISREG(os.stat(path, follow_symlinks=follow).st_mode):
        raise ValueError(f"{path} is not a regular file")  # not opened: opening a device can act
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        return os.pread(fd, limit, start).decode("utf-8", "replace")
    finally:
        os.close(fd)


def source_lines(path):
    """The lines of a source file ([] when it is not a readable regular file)."""
    try:
        return read_file(path, SOURCE_LIMIT).splitlines()
    except (OSError, ValueError):
        return []


def source_line(path, line):
    lines = source_lines(path)
    return lines[line - 1].strip()[:160] if 0 < line <= len(lines) else ""


def pyspy_path():
    found = shutil.which("py-spy")
    if found:
        return found
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else None


def pyspy_stacks(pid, timeout, nonblocking=False):
    """``py-spy dump`` of every thread; ``nonblocking``: read without pausing the rank (faster
    on a rank with many threads, at the risk of a stack caught while it changes)."""
    exe = pyspy_path()
    if not exe:
        return None, "py-spy not installed"
    try:
        p = subprocess.run([exe, "dump", "--json", "--pid", str(pid)] + (["--nonblocking"] if nonblocking else []),
                           capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
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


def _stack_size(stack):
    """The size of the rank's faulthandler file (never through a link: the rank can replace it)."""
    info = os.stat(stack, follow_symlinks=False)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("not a regular file")
    return info.st_size


def not_handling(pid, signum):
    """Why a dump request is not sent to ``pid`` now (what /proc says the rank does with the
    signal), or None when it catches it. Since the rank wrapper's boot code sets the signal to
    "ignore" under faulthandler (rankstate.BOOT), "ignored" means faulthandler's handler was
    removed, and the default action means something else replaced it."""
    how, name = signal_disposition(pid, signum), signal_name(signum)
    if how == "caught":
        return None
    if how == "ignored":
        return (f"{name} is ignored by the program now (faulthandler's handler was removed: "
                "the program unregistered it, or Python is finalizing)")
    if how == "default":
        return (f"{name} is not caught by the program now (its handler was replaced; "
                "the default action would end the rank)")
    return f"the rank's signal handlers cannot be read (/proc/{pid}/status)"


def faulthandler_stacks(job_dir, rank, pid, timeout):
    stack = os.path.join(job_dir, f"rank.{rank}.stack")
    try:
        armed_pid, signum = (int(v) for v in read_file(stack + ".armed", 64, follow=False).split())
    except (OSError, ValueError):
        return None, "faulthandler not armed (not a Python rank of dtrun's environment, or not started yet)"
    if armed_pid != pid:
        return None, "faulthandler armed by another process"
    try:
        start = _stack_size(stack)
    except (OSError, ValueError) as exc:
        return None, f"no faulthandler file ({getattr(exc, 'strerror', None) or exc}): the rank is ending"
    # The .armed file outlives the handler: Python removes it while shutting down (a rank
    # waiting in MPI_Finalize) and a program may unregister or replace it, and then the
    # signal's default action would kill the rank. So the handler is looked up right before the
    # signal is sent. It can still be removed in between: the rank wrapper's boot code makes
    # "ignore" what faulthandler leaves behind (rankstate.BOOT), so such a late request is dropped.
    why = not_handling(pid, signum)
    if why is not None:
        return None, why
    try:
        os.kill(pid, signum)
    except OSError as exc:
        return None, f"cannot signal pid {pid}: {exc.strerror}"
    return _read_dump(stack, start, timeout)


def _read_dump(stack, start, timeout):
    """The dump faulthandler appends to ``stack`` (past ``start``) once it stops growing."""
    deadline, size, stable = time.monotonic() + timeout, start, 0
    try:
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = _stack_size(stack)
            stable = stable + 1 if (now == size and now > start) else 0
            size = now
            if stable >= 3:
                break
        if size <= start:
            return None, f"faulthandler wrote nothing within {timeout:g} s"
        return parse_faulthandler(read_file(stack, min(size - start, STACK_LIMIT), start, follow=False)), None
    except (OSError, ValueError) as exc:
        return None, f"its faulthandler file went away ({getattr(exc, 'strerror', None) or exc}): the rank ended"


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
