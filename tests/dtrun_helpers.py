"""Running the installed dtrun console script as users do, with a timeout."""
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DTRUN = str(BIN / "dtrun")
PYTHON = str(BIN / "python")


# The tests' second local user ("dtother"; the other_user fixture in conftest.py creates it).
OTHER_UID = 4242
AS_OTHER_USER = ("setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups")

def result_records(text: str) -> list[dict]:
    """Every ``RESULT {json}`` a rank printed, in output order. Two ranks' records can share
    a line: with PYTHONUNBUFFERED=1, print() writes the text and its newline in two calls,
    and the MPI launcher forwards whatever it has read in between."""
    decoder = json.JSONDecoder()
    found, at = [], text.find("RESULT {")
    while at >= 0:
        obj, end = decoder.raw_decode(text, at + len("RESULT "))
        found.append(obj)
        at = text.find("RESULT {", end)
    return found


def user_env(**extra):
    """The environment of a user who activated the virtual environment."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("OMPI_ALLOW_RUN_AS_ROOT", None)
    env.update(extra)
    return env


def dtrun(*args, timeout=120, env=None, cwd=REPO, **kw):
    """Run dtrun to its end. On ``timeout`` it is stopped as a user would (SIGTERM, so it
    stops its job on every host; SIGKILL only if it does not end), then TimeoutExpired goes on:
    a hung test never leaves a job running into the next one."""
    proc = subprocess.Popen([DTRUN, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or user_env(), cwd=cwd, stdin=subprocess.DEVNULL, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line_error(proc, *needles):
    """Assert that dtrun refused its input as users must see it: exit 2, and on stderr
    exactly one line, ``dtrun: error: ...``, holding every needle (no traceback).

    Returns:
        That line.
    """
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, proc.stderr
    line = proc.stderr.rstrip("\n")
    assert line.startswith("dtrun: error: "), line
    for n in needles:
        assert n in line, (n, line)
    return line


def finish(proc, timeout):
    """Wait for ``proc`` (a Popen with text pipes) to end, killing it when it outlives
    ``timeout`` (then the TimeoutExpired goes on). Returns (exit code, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def wait_for_lines(proc, n, match, timeout=60):
    """Read ``proc``'s stdout until ``n`` lines satisfy ``match``; fail with its stderr if they do not come."""
    import time

    seen, deadline = 0, time.monotonic() + timeout
    while seen < n and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen += bool(match(line))
    assert seen == n, f"only {seen} of {n} ranks started: " + (proc.stderr.read() if proc.poll() is not None else "")


def interrupt_when_up(argv, ups, check_running=None, timeout_up=60, timeout_exit=30):
    """Start dtrun, wait for ``ups`` ranks to print 'up', send SIGINT, return its exit code.

    ``check_running`` runs once all ranks are up (to assert the job's processes exist).
    """
    import signal

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=user_env(), cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        wait_for_lines(proc, ups, lambda line: line.strip() == "up", timeout_up)
        if check_running:
            check_running()
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=timeout_exit)
    finally:
        if proc.poll() is None:
            proc.kill()


def exec_done(pid: int) -> bool:
    """Whether process ``pid`` has finished exec: subprocess.Popen returns once exec has closed
    the child's close-on-exec pipe, which is before the kernel has set up the new program's
    environment, and until then /proc/PID/environ reads empty (the kill agent, which proves a
    process is the job's by DTRUN_JOB_DIR there, would rightly refuse it)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return bool(f.read(1))
    except OSError:
        return False


def started(argv, **popen_kw) -> subprocess.Popen:
    """Popen ``argv`` and return once its exec is complete (``exec_done``)."""
    import time

    proc = subprocess.Popen(argv, **popen_kw)
    deadline = time.monotonic() + 30
    while not exec_done(proc.pid):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{argv[0]} did not start (pid {proc.pid})")
        time.sleep(0.01)
    return proc


def wait_until_empty(find, timeout=5.0):
    """Poll ``find()`` until it returns nothing or ``timeout`` passes; return its last answer."""
    import time

    deadline = time.monotonic() + timeout
    left = find()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = find()
    return left


def processes_with(token):
    """Live processes of this machine whose command line contains ``token``."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(token in part for part in (proc.info["cmdline"] or [])):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def command_lines(match):
    """(pid, command line) of every live process whose joined command line satisfies ``match``."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if match(cmd):
            found.append((proc.pid, cmd))
    return found


def module_cluster(n, terminate_strays=False):
    """Yield ``n`` namespace hosts for a module-scoped fixture, and take them down after
    (``terminate_strays``: first end what an earlier, interrupted run left behind)."""
    from tests import nscluster
    from tests.cluster_plugin import _terminate_gracefully, skip_if_unavailable

    skip_if_unavailable()
    if terminate_strays:
        _terminate_gracefully()
    cluster = nscluster.Cluster(n).up()
    try:
        yield cluster
    finally:
        cluster.down()


def start_script_job(job_class, cluster, tmp_path, name, text, slots, *args, env=None):
    """Write ``text`` to ``tmp_path/name`` and start ``dtrun`` on it across ``cluster``
    (``slots`` ranks per host, ``args`` before the program) as a ``job_class`` (argv, env)."""
    script = tmp_path / name
    script.write_text(text)
    hosts = ",".join(f"{h.name}:{n}" for h, n in zip(cluster.hosts, slots))
    return job_class([DTRUN, "--ssh-config", str(cluster.ssh_config), "-H", hosts, *args, "python", str(script)],
                     env=env)


@contextlib.contextmanager
def ports_dropped(cluster, host, ports: str):
    """While the block runs, ``host``'s firewall drops TCP to ``ports`` ("LOW-HIGH")."""
    rule = ["INPUT", "-p", "tcp", "--dport", ports.replace("-", ":"), "-j", "DROP"]
    cluster.exec(host, ["iptables", "-I", *rule], check=True)
    try:
        yield
    finally:
        cluster.exec(host, ["iptables", "-D", *rule], check=True)


def the_one_line(proc, needle: str) -> str:
    """The one line of the job's output with ``needle``, once the job ended well."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if needle in ln]
    assert len(said) == 1, said
    return said[0]
