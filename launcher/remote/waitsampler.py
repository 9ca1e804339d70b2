"""The far side of the straggler finding and `dtrun top`: how each rank on this host spends
its time. Standard library only; run as ``python3 -S agent.py sample JOB_DIR WINDOW [RATE [VIA]]``.

Every WINDOW seconds it prints one JSON line for this host: per rank, the CPU % and RSS
and state from /proc; for the bundled runtime, the collectives it started and the share of
time it spent inside blocking ones (the flight recorder's flag word, which the rank sets
on entry and clears on exit, read here a few hundred times a second); and where its main
thread was: ``py-spy record`` samples (faulthandler dumps as a fallback, only to a rank that
handles the signal at that moment), each counted as *waiting* when it is inside MPI,
torch.distributed, NCCL, Horovod or the bundled runtime. Every rank is measured on its own
host: nothing compares clocks across hosts. GPU use comes from ``nvidia-smi`` where it
exists. The agent ends when its output is closed, after the window in which the last
local rank ended, or after one window with ``once``.

The recorder file is the rank's to write: it is read with pread from a regular file of the
recorder's size only (``rankstate.open_recorder``), and what is wrong with it goes into the
rank's ``rec_error`` (and ``stack_error``, which `dtrun top` shows) while the rank is measured
from /proc as any other. py-spy's samples come through a pipe: no file is left when the
agent is killed with its job.
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

from dtrun import recorderfile

from . import procfs, pystacks, rankstate

# Parts of a path that make a frame a communication call: the caller is waiting for peers.
WAIT_PATHS = ("/torch/distributed/", "/mpi4py/", "/horovod/", "/nccl", "/cupy/cuda/nccl", "/deepspeed/comm/")
# mpi4py's methods are compiled (no frame of their own): the user's line that calls one is
# where the rank waits. Lower-case names that are common elsewhere (send, recv, wait) are left out.
_MPI_CALL = re.compile(
    r"\.(Barrier|Ibarrier|Allreduce|Iallreduce|Reduce|Ireduce|Bcast|Ibcast|Gather|Gatherv|Allgather|Allgatherv|"
    r"Scatter|Scatterv|Alltoall|Alltoallv|Reduce_scatter|Reduce_scatter_block|Scan|Exscan|Send|Ssend|Recv|"
    r"Sendrecv|Probe|Wait|Waitall|Waitany|Waitsome|barrier|bcast|allreduce|allgather|alltoall|gather|scatter|"
    r"sendrecv|reduce_scatter)\s*\(")
_LIBRARY = re.compile(r"/lib/python3\.\d+/|/site-packages/|/dist-packages/")
_RAW_LINE = re.compile(r"^thread \((\d+)\)(?::[^;]*)?;(.*) (\d+)$")
_RAW_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")
# Set-up calls left out of the figures, like imports (and torch's init_process_group): their
# waiting is for peers that are still starting.
RUNTIME_START_UP = ("init", "Comm.__init__", "__init__")
RUNTIME_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "collectives") + os.sep
REC_POLL_HZ = 200.0  # reads of a rank's "inside a collective" flag per second (a few microseconds each)
FH_RATE = 2.0  # faulthandler dumps per second at most: each one makes the rank write every stack
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ------------------------------------------------------------------ pure parts

def is_library(path):
    """Whether a frame's file is not the user's code (the runtime, installed packages, the
    standard library, frozen or generated code)."""
    return (path.startswith(RUNTIME_DIR) or bool(_LIBRARY.search(path)) or path.startswith(("/usr/", "<"))
            or not path.startswith("/"))


def parse_raw(text, main_tid):
    """py-spy's raw output (``record --format raw --threads``) → [(frames, count)] of the
    main thread, frames as (func, file, line), outermost first."""
    out = []
    for line in text.splitlines():
        m = _RAW_LINE.match(line.strip())
        if not m or int(m.group(1)) != main_tid:
            continue
        frames = []
        for part in m.group(2).split(";"):
            f = _RAW_FRAME.match(part)
            if f:
                frames.append((f.group(1), f.group(2), int(f.group(3))))
        out.append((frames, int(m.group(3))))
    return out


def classify(frames, code_of):
    """(waiting, user frame) for one sample, frames outermost first; ``code_of(file, line)``
    gives a source line. The user frame is the innermost one of the user's own code."""
    user, inner = None, 0
    for i in range(len(frames) - 1, -1, -1):
        if not is_library(frames[i][1]):
            user, inner = frames[i], i
            break
    # Only frames the user's code called count (a program run as ``python -m mpi4py job.py``
    # has mpi4py's launcher frames around all of its own).
    waiting = any(fr[1].startswith(RUNTIME_DIR) or any(m in fr[1] for m in WAIT_PATHS) for fr in frames[inner:])
    if not waiting and user is not None and user is frames[-1]:
        waiting = bool(_MPI_CALL.search(code_of(user[1], user[2]) or ""))
    return waiting, user


def summarise(samples, code_of):
    """Per-window figures from [(frames, count)]: samples, waiting samples, start-up samples
    (left out of the others), and the user frames the rank was in, most frequent first:
    [[func, file, line, count, waiting], ...]."""
    total = waiting = startup = 0
    where = {}
    for frames, n in samples:
        if any(fr[1].startswith("<frozen importlib") or fr[0] == "init_process_group"
               or (fr[0] in RUNTIME_START_UP and fr[1].startswith(RUNTIME_DIR)) for fr in frames):
            startup += n  # every rank does it once, and its waiting is for slower starters
            continue
        w, user = classify(frames, code_of)
        total += n
        waiting += n if w else 0
        if user is not None:
            key = (user[0], user[1], user[2], w)
            where[key] = where.get(key, 0) + n
    top = sorted(where.items(), key=lambda kv: -kv[1])[:4]
    return {"samples": total, "waiting": waiting, "startup": startup,
            "frames": [[f, p, ln, n, w] for (f, p, ln, w), n in top]}


def parse_nvidia_smi(gpus_csv, apps_csv):
    """nvidia-smi's CSV (``--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total`` and
    ``--query-compute-apps=pid,gpu_uuid,used_memory``) → (gpus, {pid: [(index, MiB)]})."""
    gpus, by_uuid, apps = [], {}, {}
    for line in gpus_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            g = {"index": int(parts[0]), "util": _num(parts[2]), "mem_used": _num(parts[3]),
                 "mem_total": _num(parts[4])}
        except ValueError:
            continue
        gpus.append(g)
        by_uuid[parts[1]] = g["index"]
    for line in apps_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit() or parts[1] not in by_uuid:
            continue
        apps.setdefault(int(parts[0]), []).append((by_uuid[parts[1]], _num(parts[2])))
    return gpus, apps


def _num(text):
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


# ------------------------------------------------------------------ reading a rank


def recorder_seq(job_dir, rank, pid):
    """(the newest sequence number in the rank's flight recorder or None, why its file was not
    read or None): no recorder, or another process's, is (None, None)."""
    words, why = rankstate.read_recorder(job_dir, rank)
    if words is None or words[2] != pid:
        return None, why
    return recorderfile.newest_seq(words), None


def poll_inside(job_dir, rank, pid, until, hz=REC_POLL_HZ, problems=None):
    """(polls, polls that found the rank inside a blocking collective) until ``until``
    (monotonic) or the rank's end, reading the recorder's flag word with pread (a mapping would
    kill the agent with SIGBUS when the file is truncated under it); None when the rank has no
    recorder of a format with the flag. Why the file was not read, or stopped being readable,
    is appended to ``problems``."""
    import struct

    fd, why = rankstate.open_recorder(job_dir, rank)
    if fd is None:
        if why and problems is not None:
            problems.append(why)
        return None
    name = recorderfile.file_name(rank)
    try:
        head = os.pread(fd, 24, 0)
        if len(head) < 24:
            return None
        magic, version, rpid = struct.unpack("qqq", head)
        if magic != recorderfile.MAGIC or version < recorderfile.INSIDE_SINCE or rpid != pid:
            return None
        polls = inside = 0
        off, step = 8 * recorderfile.INSIDE_WORD, 1.0 / hz
        while time.monotonic() < until:
            word = os.pread(fd, 8, off)
            if len(word) < 8:
                if problems is not None:
                    problems.append(f"{name} was truncated while read ({os.fstat(fd).st_size} bytes left)")
                break
            polls += 1
            inside += struct.unpack("q", word)[0] != 0
            if polls % 50 == 0 and not os.path.exists(f"/proc/{pid}"):
                break
            time.sleep(step)
        return polls, inside
    except OSError as exc:
        if problems is not None:
            problems.append(f"{name} cannot be read ({exc.strerror})")
        return None
    finally:
        os.close(fd)


class _Source:
    """Source lines for classifying samples, read once per file."""

    def __init__(self):
        self.files = {}

    def __call__(self, path, line):
        if path not in self.files:  # a regular file only (a frame can name a FIFO): pystacks.read_file
            self.files[path] = pystacks.source_lines(path)
        lines = self.files[path]
        return lines[line - 1] if 0 < line <= len(lines) else ""


def pyspy_record(pid, seconds, rate):
    """py-spy samples of the main thread over ``seconds`` (fewer when the rank ends first)."""
    exe = pystacks.pyspy_path()
    if not exe:
        return None, "py-spy not installed"
    # The samples come on py-spy's own stdout (with its few "py-spy>" lines, which parse_raw
    # skips): no file of them anywhere, so none is left behind when the agent is killed.
    try:
        p = subprocess.run([exe, "record", "--pid", str(pid), "--duration", str(max(1, int(round(seconds)))),
                            "--rate", f"{rate:g}", "--format", "raw", "--idle", "--nonblocking", "--threads",
                            "--full-filenames", "-o", "/proc/self/fd/1"], capture_output=True, text=True,
                           errors="replace", timeout=seconds + 10, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, "py-spy gave no answer"
    except OSError as exc:
        return None, f"py-spy: {exc.strerror}"
    text = p.stdout
    if p.returncode != 0 and not any(_RAW_LINE.match(ln.strip()) for ln in text.splitlines()):
        lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip()]
        why = next((ln for ln in lines if ln.startswith("Error:")), lines[-1] if lines else "failed")
        return None, "py-spy: " + why[:200]
    return parse_raw(text, pid), None


def faulthandler_samples(job_dir, rank, pid, seconds):
    """Stacks from the rank's faulthandler, at most FH_RATE a second (the agent asks only
    when the rank handles the signal at that moment, never otherwise)."""
    samples, err, deadline = [], None, time.monotonic() + seconds
    while time.monotonic() < deadline:
        t = time.monotonic()
        threads, err = pystacks.faulthandler_stacks(job_dir, rank, pid, 1.0)
        if threads is None:
            break
        main = next((th for th in threads if th.get("main")), threads[0] if threads else None)
        if main is not None:
            samples.append(([(fr["func"], fr["file"], fr["line"]) for fr in reversed(main["frames"])], 1))
        time.sleep(max(0.0, 1.0 / FH_RATE - (time.monotonic() - t)))
    if not samples:
        return None, err or "faulthandler: no dump"
    return samples, None


def _cwd_paths(samples, pid):
    """Relative paths (as the program was started: ``python job.py``) made absolute."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return samples
    return [([(f, p if p.startswith(("/", "<")) else os.path.join(cwd, p), ln) for f, p, ln in frames], n)
            for frames, n in samples]


def _stack_samples(job_dir, rank, pid, until, rate, via, out):
    """py-spy's samples of the rank's main thread until ``until`` (monotonic), else its
    faulthandler's: (samples or None, why there are none); sets ``out["via"]``."""
    samples, errors = None, []
    if via not in ("faulthandler", "proc"):
        samples, err = pyspy_record(pid, max(0.0, until - time.monotonic()), rate)
        out["via"] = "py-spy"
        if samples is None:
            errors.append(err)
    if samples is None and via != "proc":
        samples, err = faulthandler_samples(job_dir, rank, pid, max(0.0, until - time.monotonic()))
        out["via"] = "faulthandler"
        if samples is None:
            errors.append(err)
    return samples, "; ".join(e for e in errors if e)


def sample_rank(job_dir, st, window, rate, via):
    rank, pid = st["rank"], st.get("pid")
    out = {"rank": rank, "pid": pid}
    refusal = rankstate.job_process(job_dir, pid, st.get("start"))
    if refusal is not None:
        out["error"] = "process has exited" if refusal.exited else f"not examined: {refusal.why}"
        return out
    t0, p0 = time.monotonic(), procfs.proc_sample(pid)
    r0, why0 = recorder_seq(job_dir, rank, pid)
    polled, problems = [None], [why0] if why0 else []
    poller = threading.Thread(target=lambda: polled.__setitem__(
        0, poll_inside(job_dir, rank, pid, t0 + window, problems=problems)), daemon=True)
    poller.start()
    exe = procfs.proc_info(pid).get("exe", "")
    python = "python" in exe or os.path.exists(os.path.join(job_dir, f"rank.{rank}.stack.armed"))
    samples, stack_error = _stack_samples(job_dir, rank, pid, t0 + window, rate, via, out) if python else (None, "")
    while time.monotonic() < t0 + window and procfs.proc_sample(pid) is not None:
        time.sleep(0.05)
    poller.join(window + 5)
    t1, p1 = time.monotonic(), procfs.proc_sample(pid)
    r1, why1 = recorder_seq(job_dir, rank, pid)
    out["span"] = round(t1 - t0, 3)
    last = p1 or p0
    if last is not None:
        out["rss"], out["state"] = last[1], last[2]
    if p0 is not None and p1 is not None and t1 > t0:
        out["cpu"] = round(100.0 * (p1[0] - p0[0]) / TICKS / (t1 - t0), 1)
    out["ended"] = p1 is None
    if r1 is not None:
        out["seq"] = r1
        if r0 is not None:
            out["colls"] = r1 - r0
    if polled[0] is not None:
        out["rec_polls"], out["rec_inside"] = polled[0]
    if samples is not None:
        out.update(summarise(_cwd_paths(samples, pid), _Source()))
    _note_problems(out, stack_error, problems + ([why1] if why1 else []))
    if polled[0] is not None and polled[0][0]:
        out["via"] = "recorder"  # the waiting share; samples, where there are some, give the frames
    elif samples is None:
        out["via"] = "proc"
    return out


def _note_problems(out, stack_error, recorder_problems):
    """Why there are no stack samples, and what is wrong with the rank's recorder file (the
    rank is measured all the same: ``stack_error`` is what `dtrun top` shows of a rank)."""
    rec = "; ".join(dict.fromkeys(recorder_problems))
    if rec:
        out["rec_error"] = "flight recorder not read: " + rec
    text = "; ".join(t for t in (stack_error, out.get("rec_error")) if t)
    if text:
        out["stack_error"] = text


def gpu_use():
    """(gpus, {pid: [(index, MiB)]}) from nvidia-smi, or ([], {}) where there is none."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return [], {}
    try:
        g = subprocess.run([exe, "--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
        a = subprocess.run([exe, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return [], {}
    return parse_nvidia_smi(g.stdout, a.stdout)


def sample_host(job_dir, window, rate, via):
    """One window on this host: every local rank at once."""
    ranks = rankstate.host_ranks(job_dir)
    results = [None] * len(ranks)
    gpu = [([], {})]

    def work(i, st):
        try:
            results[i] = sample_rank(job_dir, st, window, rate, via)
        except Exception as exc:  # one rank's failure must not hide the others
            results[i] = {"rank": st.get("rank"), "pid": st.get("pid"), "error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=work, args=(i, st), daemon=True) for i, st in enumerate(ranks)]
    threads.append(threading.Thread(target=lambda: gpu.__setitem__(0, gpu_use()), daemon=True))
    for t in threads:
        t.start()
    deadline = time.monotonic() + window + 15  # one deadline for all: a stuck rank delays no other
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    gpus, apps = gpu[0]
    out = [r if r is not None else {"rank": st.get("rank"), "pid": st.get("pid"),
                                    "error": f"not measured within {window + 15:g} s"}
           for r, st in zip(results, ranks)]
    for r in out:
        if r.get("pid") in apps:
            used = apps[r["pid"]]
            r["gpu_mem"] = sum(m or 0 for _, m in used)
            utils = [g["util"] for g in gpus if g["index"] in {i for i, _ in used} and g["util"] is not None]
            r["gpu_util"] = max(utils) if utils else None
    return {"host": socket.gethostname(), "window": window, "ranks": out, "gpus": gpus}


def run(job_dir, window, rate=10.0, via="auto", once=False):
    """Print one line per window until the output is closed, the local ranks ended, or once."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    seen = False
    while True:
        t0 = time.monotonic()
        line = sample_host(job_dir, window, rate, via)
        live = [r for r in line["ranks"] if "error" not in r and not r.get("ended")]
        seen = seen or bool(line["ranks"])
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
        if once or (seen and not live):
            return 0
        if not line["ranks"]:
            time.sleep(max(0.0, window - (time.monotonic() - t0)))  # nothing here yet: an empty line a window
