"""The bytes dtrun writes: mpirun's own text without control characters, a rank's output unchanged,
dtrun's own lines on fresh lines, and the cut-short warning naming only ranks whose output was cut.

Open MPI 5 (PRRTE) writes a NUL after its "PRTE has lost communication with a remote daemon"
message (a write(2, "\\0", 1) of its own, no newline after it), and then exits 0; dtrun used to pass
the NUL on (its next line glued to it: `grep` called the output binary) and took the exit code 0
for a clean end (every rank named as cut short, those of the lost host too).
"""
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dtrun.launcher.job import parsers
from dtrun.launcher.job.result import JobResult, RankFailure
from dtrun.launcher.job.summary import failure_summary
from tests import nscluster
from tests.dtrun_helpers import DTRUN, PYTHON, REPO, user_env

CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1a\x1c-\x1f\x7f]")
RANK_LINE = re.compile(rb"\[\d+,\d+\]<std(?:out|err)>:")
FRAME = b"-" * 74 + b"\n"
LOST = (FRAME + b"PRTE has lost communication with a remote daemon.\n\n"
        b"  HNP daemon   : [prterun-vm-1@0,0] on node vm\n"
        b"  Remote daemon: [prterun-vm-1@0,2] on node h2\n\n"
        b"therefore will terminate the job.\n" + FRAME)


# ---- by value ------------------------------------------------------------------------------------

def test_mpiruns_control_bytes_are_dropped_or_escaped_and_tab_cr_lf_esc_kept():
    assert parsers.escape_controls(b"a\x00b\x07c\x08\td\r\n\x1b[1mbold\x7f") == b"ab\\x07c\\x08\td\r\n\x1b[1mbold\\x7f"
    assert parsers.escape_controls(b"\x00") == b""


def test_dtruns_own_text_keeps_only_its_newlines():
    assert parsers.plain_text("dtrun: host h\x002 \x1b[31mred\t\n") == "dtrun: host h2 \\x1b[31mred\\x09\n"


def test_the_nul_after_prteruns_message_is_dropped_and_ranks_lines_pass_unchanged():
    own = parsers.LauncherStderr()  # --no-tag-output: a rank's line cannot be told from mpirun's
    assert [own.clean(line) for line in LOST.splitlines(keepends=True)] == LOST.splitlines(keepends=True)
    assert own.clean(b"\x00") == b""  # PRRTE's NUL, alone at the end of its stderr
    assert own.clean(FRAME) == FRAME and own.clean(b"\x00\x00rank text\x00\n") == b"rank text\x00\n"
    assert own.clean(b"\x00a rank's \x07 line\n") == b"\x00a rank's \x07 line\n"  # not after a frame


def test_tagged_jobs_untagged_lines_are_mpiruns_and_lose_their_control_bytes():
    own = parsers.LauncherStderr()
    own.saw_start_marker(b"[1,0]<stderr>: dtrun-rank-start: token=ab rank=0 host=h1\n")
    assert own.clean(b"[1,2]<stderr>: a rank's \x00\x07 bytes\n") == b"[1,2]<stderr>: a rank's \x00\x07 bytes\n"
    assert own.clean(b"\x00[1,2]<stderr>: x\x00\n") == b"[1,2]<stderr>: x\x00\n"
    assert own.clean(b"[vm:12] plm:ssh: odd\x07\x00\n") == b"[vm:12] plm:ssh: odd\\x07\n"
    assert own.clean(b"Connection to 10.0.0.2 closed by remote host.\r\n") == \
        b"Connection to 10.0.0.2 closed by remote host.\r\n"


def test_host_names_read_from_mpiruns_text_stop_at_a_control_byte():
    text = LOST.decode().replace("on node h2\n", "on node h2\x00\n")
    assert parsers.lost_daemon_host(text) == "h2"


def test_the_summary_carries_no_control_byte_of_a_name():
    result = JobResult(returncode=1, mpirun_returncode=1, failures=[RankFailure("3", "h\x1b]0;x\x07", code=1)],
                       notes=["the end of the output of rank 3 on h\x00 did not arrive"])
    text = failure_summary(result)
    assert not CONTROL.search(text.encode()) and "\x1b" not in text, text


# ---- a job through dtrun's supervisor, mpirun played by a script ------------------------------------

FAKE_MPIRUN = textwrap.dedent('''\
    import os, sys, time
    from dtrun.launcher.remote import wire
    token = os.environ[wire.MARKER_TOKEN_ENV]
    out, err = sys.stdout.buffer, sys.stderr.buffer
    def say(stream, data):
        stream.write(data); stream.flush()
    for r in range(3):
        say(err, b"[1,%d]<stderr>: " % r + wire.start_line(token, r, "h%d" % (r + 1)).encode())
    say(out, b"[1,0]<stdout>: a rank's own \\x00 byte\\n[1,1]<stdout>: step 1\\n")
    say(err, b"[1,2]<stderr>: " + wire.exit_line(token, 2, "h3", time.time(), signum=15, forwarded=True).encode())
    say(err, LOST)
    say(err, b"\\x00")  # prterun's own write(2, "\\0", 1) after its message
    sys.exit(0)  # Open MPI 5 exits 0 after losing a daemon
''')
RUNNER = textwrap.dedent('''\
    import sys
    from dtrun.launcher.job.summary import failure_summary
    from dtrun.launcher.job.supervisor import run_job
    result = run_job([sys.executable, sys.argv[1]], expected=("h1", "h2", "h3"))
    if result.returncode != 0 or result.notes:
        print(failure_summary(result), file=sys.stderr)  # as launcher/jobend.py does
''')


def test_lost_daemon_job_output_has_no_nul_and_names_only_the_cut_rank(tmp_path):
    """Rank 2's exit marker came and its last line did not: its output was cut. Ranks 0 and 1 were
    killed before their wrappers wrote anything (1 with its host): they are not named."""
    (tmp_path / "mpirun.py").write_text(f"LOST = {LOST!r}\n" + FAKE_MPIRUN)
    (tmp_path / "runner.py").write_text(RUNNER)
    p = subprocess.run([sys.executable, tmp_path / "runner.py", tmp_path / "mpirun.py"], cwd=REPO, timeout=60,
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    out = p.stdout
    assert b"[1,0]<stdout>: a rank's own \x00 byte\n" in out  # a rank's output, unchanged
    assert not CONTROL.search(out.replace(b"[1,0]<stdout>: a rank's own \x00 byte\n", b"")), out
    assert re.search(rb"(?m)^dtrun: warning: the end of the output of rank 2 on h3 did not arrive", out), out
    assert b"rank 0 on" not in out and b"rank 1 on" not in out, out
    assert re.search(rb"(?m)^dtrun: job failed: the MPI daemon on h2 died", out), out


def test_dtruns_own_line_starts_on_a_fresh_line_after_an_open_one(tmp_path):
    (tmp_path / "mpirun.py").write_text("import sys\nsys.stderr.write('a line without its newline')\nsys.exit(3)\n")
    (tmp_path / "runner.py").write_text(RUNNER)
    p = subprocess.run([sys.executable, tmp_path / "runner.py", tmp_path / "mpirun.py"], cwd=REPO, timeout=60,
                       stdin=subprocess.DEVNULL, capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.stderr.startswith(b"a line without its newline\ndtrun: job failed: "), p.stderr


# ---- a real job on namespace hosts under Open MPI 5, one host lost -------------------------------

JOB = textwrap.dedent('''\
    import sys, time
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    for i in range(600):
        c.allreduce(i)
        line = f"step {i} rank {c.rank}"
        print(line, flush=True)
        with open(f"{sys.argv[1]}/rank{c.rank}.txt", "a") as f:  # what was printed (shared file system)
            f.write(line + "\\n")
        time.sleep(0.1)
''')


def _crash(host, freeze_sshd):
    """Kill every process of ``host``'s namespace; ``freeze_sshd``: stop its sshd processes instead,
    so that prterun learns of the loss through its daemon's connection, not its ssh child's exit."""
    for pid in nscluster._netns_pids(host.netns):
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            os.kill(pid, signal.SIGSTOP if freeze_sshd and comm.startswith("sshd") else signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _run_losing(cluster, tmp_path, victim):
    """dtrun's combined stdout and stderr (as `2>&1`), ``victim`` lost after step 5."""
    (tmp_path / "job.py").write_text(JOB)
    hosts = ",".join(f"{h.name}:1" for h in cluster.hosts)
    p = subprocess.Popen([DTRUN, "--ssh-config", str(cluster.ssh_config), "-H", hosts, PYTHON,
                          str(tmp_path / "job.py"), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=user_env(), cwd=REPO, stdin=subprocess.DEVNULL)
    out = bytearray()

    def read():
        for chunk in iter(lambda: os.read(p.stdout.fileno(), 1 << 16), b""):
            out.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while b"step 5 rank 0" not in out and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert b"step 5 rank 0" in out, bytes(out[-3000:])
        _crash(victim, freeze_sshd=True)
        p.wait(120)
    finally:
        _crash(victim, freeze_sshd=False)
        if p.poll() is None:
            p.kill()
            p.wait()
        reader.join(10)
    return p.returncode, bytes(out)


@pytest.mark.cluster
@pytest.mark.mpi
def test_lost_host_output_has_no_control_bytes_and_the_warning_names_only_cut_ranks(make_cluster, tmp_path):
    cluster = make_cluster(3)
    rc, out = _run_losing(cluster, tmp_path, cluster.hosts[1])
    assert rc != 0, out[-3000:]
    for line in out.splitlines():
        assert RANK_LINE.match(line) or not CONTROL.search(line), (line, out[-3000:])
    assert not re.search(rb"[^\n]dtrun: ", out), out[-3000:]  # each of dtrun's lines on a fresh line
    named = re.search(rb"dtrun: warning: the end of the output of (.*) did not arrive", out)
    cut = set()
    for r in range(3):
        printed = (tmp_path / f"rank{r}.txt").read_text().splitlines()
        if any(f"[1,{r}]<stdout>: {line}\n".encode() not in out for line in printed):
            cut.add(str(r))
    named_ranks = set(re.findall(rb"rank (\d+) on", named.group(1))) if named else set()
    assert {r.decode() for r in named_ranks} <= cut, (cut, out[-3000:])


KILLED_MPIRUN = textwrap.dedent('''\
    import os, sys, time
    from dtrun.launcher.remote import wire
    token = os.environ[wire.MARKER_TOKEN_ENV]
    err = sys.stderr.buffer
    for r in range(2):
        err.write(b"[1,%d]<stderr>: " % r + wire.start_line(token, r, "h%d" % (r + 1)).encode())
    # rank 0 saw its peer's socket close and aborted first; rank 1 died with its wrapper (no marker)
    err.write(b"[1,0]<stderr>: " + wire.exit_line(token, 0, "h1", time.time(), code=1).encode())
    err.write(b"prterun noticed that process rank 1 with PID 4242 on node h2 exited on signal 9 (Killed).\\n")
    err.flush()
    sys.exit(137)
''')


def test_a_rank_killed_with_its_wrapper_is_the_cause_not_the_abort_it_provoked(tmp_path):
    (tmp_path / "mpirun.py").write_text(KILLED_MPIRUN)
    (tmp_path / "runner.py").write_text(RUNNER.replace('("h1", "h2", "h3")', '("h1", "h2")'))
    p = subprocess.run([sys.executable, tmp_path / "runner.py", tmp_path / "mpirun.py"], cwd=REPO, timeout=60,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert re.search(r"(?m)^dtrun: job failed: rank 1 on h2 killed by SIGKILL", p.stderr), p.stderr
