"""Reading /proc: when a process started, its state and parent, the signals it handles, what it
runs. Standard library only; used on every host by the agent, the rank state files and the
session-directory sweep, and by the launcher to find a job's processes.

A pid alone names a process only until it ends: (pid, start time in clock ticks) names one
process for good, so every check that acts on a recorded pid compares both.
"""
import os

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def proc_start(pid):
    """(name, start time in clock ticks) of a live process, or None: together they tell a
    process from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    name = raw[raw.find(b"(") + 1:raw.rfind(b")")].decode("utf-8", "replace")
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return name, int(fields[19])
    except (IndexError, ValueError):
        return None


# Above the largest pid Linux hands out (PID_MAX_LIMIT): a bigger number in a state file is
# not a process id (and would overflow os.kill).
PID_LIMIT = 1 << 22


def valid_pid(pid):
    """``pid`` when it can name one ordinary process (an int above 1: not init, not a
    process group, not "every process"), else None."""
    return pid if type(pid) is int and 1 < pid < PID_LIMIT else None


def stat_fields(pid):
    """The fields of /proc/PID/stat after the name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2:].split()


def proc_parent(pid):
    try:
        return int(stat_fields(pid)[1])
    except (TypeError, IndexError, ValueError):
        return None


def gone(pid, start):
    """Whether the process recorded as (pid, start) has ended: no such pid, a later process
    with it, or a zombie waiting for its parent."""
    if valid_pid(pid) is None:
        return True
    fields = stat_fields(pid)
    try:
        return fields is None or int(fields[19]) != start or fields[0] in (b"Z", b"X")
    except (IndexError, ValueError):
        return True


def signal_disposition(pid, signum):
    """What ``pid`` does with ``signum`` now, from /proc/PID/status: "caught" (SigCgt: a
    handler), "ignored" (SigIgn), "default" (neither: the default action), or None when that
    cannot be read."""
    masks = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("SigCgt:", "SigIgn:")):
                    masks[line[:6]] = int(line.split()[1], 16) >> (signum - 1) & 1
    except (OSError, ValueError, IndexError):
        return None
    if len(masks) < 2:
        return None
    return "caught" if masks["SigCgt"] else "ignored" if masks["SigIgn"] else "default"


def signal_caught(pid, signum):
    """Whether ``pid`` has a handler for ``signum`` now (SigCgt in /proc/PID/status, a hex
    mask with bit signum-1), False when it has none, None when that cannot be read."""
    how = signal_disposition(pid, signum)
    return None if how is None else how == "caught"


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


def proc_sample(pid):
    """(cpu ticks, rss bytes, state letter) from /proc, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rfind(b")") + 2:].split()
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * PAGE
        return int(fields[11]) + int(fields[12]), rss, fields[0].decode()
    except (OSError, IndexError, ValueError):
        return None
