"""Hardening, round 2, of what dtrun writes and reads: --log-dir in a shared place, a long
line without a newline, a program that prints the rank wrapper's markers itself, and
naming the launcher that ran (srun, mpiexec, mpirun) when it fails.

Real processes throughout: the installed dtrun with Open MPI 5 and Debian's MPICH, the
rank wrapper run as MPI runs it, and a real Slurm on namespace hosts for srun.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys

import pytest

from dtrun.launcher.remote import rankexec
from dtrun.launcher.job.markers import parse_marker, parse_start_marker, split_eof_markers
from dtrun.launcher.job.result import JobResult, StopReason, StopState
from dtrun.launcher.job.summary import failure_summary
from tests.dtrun_helpers import DTRUN, PYTHON, REPO, dtrun, user_env

HOST = socket.gethostname()
MPICH = "/usr/bin/mpiexec.mpich"
OTHER_UID = 4242  # no such user here: "another user" of a shared directory
RUN_NAME = re.compile(r"\d{8}-\d{6}-\d+-[0-9a-f]{8}")


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _runs(logs) -> list[str]:
    return sorted(n for n in os.listdir(logs) if n != "latest")


# ---- item 6: --log-dir in a shared directory -------------------------------------------------

def test_log_dir_run_directory_is_private_and_unguessable(tmp_path):
    """The run's directory is 0700, each rank.N.log 0600 (whatever the umask allows more),
    and its name ends in a random part: two runs of one second and pid never share it."""
    logs = tmp_path / "logs"
    p = dtrun("-np", "2", "--log-dir", logs, "python", "-c", "import os; print('from', os.environ['DTRUN_RANK'])")
    assert p.returncode == 0, p.stderr
    (run,) = _runs(logs)
    assert RUN_NAME.fullmatch(run), run
    assert _mode(logs / run) == 0o700
    assert sorted(os.listdir(logs / run)) == ["rank.0.log", "rank.1.log"]
    assert [_mode(logs / run / f"rank.{r}.log") for r in (0, 1)] == [0o600, 0o600]
    assert (logs / run / "rank.1.log").read_text() == "from 1\n"
    assert os.readlink(logs / "latest") == run
    from dtrun.launcher.launch import new_run_id

    assert new_run_id(now=1e9, pid=7) != new_run_id(now=1e9, pid=7)


@pytest.mark.parametrize("planted", ["other-users-dir", "symlink-to-victim"])
def test_log_dir_never_reuses_a_run_directory_that_exists(tmp_path, monkeypatch, capsys, planted):
    """Someone who knows the run's directory name (as the old time-and-pid name let anyone
    guess) creates it first: dtrun refuses with one line and exit 2, writes nothing there."""
    from dtrun.launcher import cli, launch

    logs, victim = tmp_path / "logs", tmp_path / "victim"
    logs.mkdir()
    victim.mkdir()
    (victim / "keep").write_text("theirs\n")
    target = logs / "guessed"
    if planted == "other-users-dir":
        target.mkdir(mode=0o777)
        os.chmod(target, 0o777)
        os.chown(target, OTHER_UID, OTHER_UID)
    else:
        target.symlink_to(victim)
    monkeypatch.setattr(launch, "new_run_id", lambda: "guessed")
    monkeypatch.setenv("PATH", user_env()["PATH"])
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["-np", "1", "--log-dir", str(logs), PYTHON, "-c", "print('ran')"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, err
    assert err == (f"dtrun: error: --log-dir: {target} exists already: each run writes into a new directory that it "
                   "creates itself, never into one made by another run or another user\n")
    assert "ran" not in out
    assert sorted(os.listdir(victim)) == ["keep"] and (victim / "keep").read_text() == "theirs\n"
    if planted == "other-users-dir":
        assert os.listdir(target) == []


def test_log_dir_latest_planted_as_a_directory_is_left_alone(tmp_path):
    """DIR/latest is replaced by a rename, never followed; a directory of that name stays as it
    is, the run goes on, and no temporary link is left behind."""
    logs = tmp_path / "logs"
    (logs / "latest").mkdir(parents=True)
    os.chown(logs / "latest", OTHER_UID, OTHER_UID)
    p = dtrun("-np", "1", "--log-dir", logs, "python", "-c", "print('ok')")
    assert p.returncode == 0, p.stderr
    (run,) = _runs(logs)
    assert sorted(os.listdir(logs)) == sorted(["latest", run])  # no latest.PID or .latest.* left
    assert os.listdir(logs / "latest") == [] and os.lstat(logs / "latest").st_uid == OTHER_UID
    assert (logs / run / "rank.0.log").read_text() == "ok\n"


def _planted_log(run, victim):
    run.mkdir(mode=0o700)
    (run / "rank.0.log").symlink_to(victim)
    return f"--log-dir: {run}/rank.0.log exists already (a link or a file: each run's logs are new files)"


def _other_users_dir(run, victim):
    run.mkdir(mode=0o700)
    os.chown(run, OTHER_UID, OTHER_UID)
    return (f"--log-dir: {run} belongs to uid {OTHER_UID}, not to this user (uid {os.geteuid()}): a run's log "
            "directory is always new and private")


def _symlinked_dir(run, victim):
    run.symlink_to(victim.parent)
    return f"--log-dir: cannot use {run}: it is a symbolic link or not a directory"


def _group_writable_dir(run, victim):
    run.mkdir()
    os.chmod(run, 0o777)
    return f"--log-dir: {run} is writable by other users (mode 777)"


@pytest.mark.parametrize("plant", [_planted_log, _other_users_dir, _symlinked_dir, _group_writable_dir],
                         ids=["planted-rank-log-symlink", "dir-of-another-uid", "dir-is-a-symlink", "dir-writable-by-all"])
def test_rank_log_is_never_written_through_what_another_user_planted(tmp_path, plant):
    """The rank wrapper on a host where the run's directory was made before it ran (no shared
    file system, or a guessed name): a planted rank.0.log link, a directory of another uid,
    a link in place of the directory, or one that anybody can write to. The rank does not
    run, the file the plant pointed at is untouched, and dtrun names the log, why, and the host."""
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir / "owned-by-root"
    victim.write_text("precious\n")
    os.chmod(victim, 0o644)
    run = tmp_path / "logs" / "run"
    run.parent.mkdir()
    head = plant(run, victim)
    # the user's -x replaces dtrun's own DTRUN_LOG_DIR: the rank finds the planted directory
    p = dtrun("-np", "1", "-x", f"DTRUN_LOG_DIR={run}", "python", "-c", "print('the program ran')")
    assert victim.read_text() == "precious\n" and sorted(os.listdir(victim_dir)) == ["owned-by-root"]
    assert "the program ran" not in p.stdout
    assert p.returncode == 1, p.stderr
    assert f"dtrun: job failed: {head} on {HOST} (rank 0)" in p.stderr.splitlines(), p.stderr


# ---- item 8: a long line without a newline ---------------------------------------------------

def _feed(split, data: str, chunk: int = 1 << 16, **kw):
    """Feed ``data`` to ``split`` as dtrun's stdout reader does; return the output, the
    characters it was handed in all (the held-back tail is handed again), and the largest tail."""
    held, out, handed, most = "", [], 0, 0
    for i in range(0, len(data), chunk):
        text = held + data[i:i + chunk]
        handed += len(text)
        passed, held = split(text, set(), **kw)
        out.append(passed)
        most = max(most, len(held))
    return "".join(out) + held, handed, most


LOOKALIKE = "dtrun-rank-eof: rank=0 "  # a marker's text with more after it: not a marker


@pytest.mark.parametrize("line", [
    LOOKALIKE + "abcdefghij" * 400_000,  # a marker's look-alike, then 4 MB on the same line
    "[1,0]<stdout>: " + LOOKALIKE + "x" * 4_000_000,  # the same after a rank tag
    "dtrun-rank-eof: rank=" + "7" * 4_000_000,  # a marker's start and a number that never ends
], ids=["lookalike", "tagged-lookalike", "endless-rank-number"])
def test_a_long_line_without_newline_is_read_once(line):
    """dtrun holds back only what may still become a marker (a rank tag and a marker at most),
    so each character of a growing line is handed to the scan about once, not once per chunk."""
    out, handed, most = _feed(split_eof_markers, line)
    assert out == line
    assert most <= 200, most
    assert handed <= len(line) + 200 * (len(line) // (1 << 16) + 1), handed


def test_a_chunk_full_of_marker_first_letters_costs_a_bounded_number_of_string_operations():
    """The end of a chunk is checked for a marker's start only where one could fit: a chunk
    with a "d" in every place does not make one string operation (and copy) per "d"."""
    calls = []

    def count(frame, event, arg):
        if event == "c_call":
            calls.append(arg)

    chunk = "d" * (1 << 16)
    sys.setprofile(count)
    try:
        passed, held = split_eof_markers(chunk, set())
    finally:
        sys.setprofile(None)
    assert passed + held == chunk and len(held) == 1
    assert len(calls) < 200, len(calls)


def test_marker_in_a_chunk_of_its_own_keeps_the_newline_of_an_unfinished_line():
    """Hydra passes "partial line" and the wrapper's marker in separate reads: the marker is
    glued to that line (not a line of its own), so its newline stays, as when both come at once."""
    token, seen = "abc123", set()
    first, held = split_eof_markers("no newline then", seen, token)
    second, rest = split_eof_markers(held + f"dtrun-rank-eof: token={token} rank=0\n", seen, token,
                                     line_start=first.endswith("\n"))
    assert (first + second, rest, seen) == ("no newline then\n", "", {"0"})


@pytest.mark.flavor
@pytest.mark.mpi
def test_ten_megabyte_line_without_newline_arrives_whole_while_the_rank_runs(tmp_path):
    """A rank writes 10 MiB on one line without a newline (starting like a marker, with a "d" every
    few bytes), then waits before it exits: the whole line reaches dtrun's stdout while the rank
    still runs (nothing is held back until its end), byte for byte, then the newline dtrun ends
    an unfinished last line with. MPICH's Hydra passes such a line on at once (Open MPI's own
    forwarding of it takes most of a minute: benchmarks/bench_output.py)."""
    import select
    import time

    if not os.path.exists(MPICH):
        pytest.skip(f"{MPICH} not installed (Debian mpich)")
    release = tmp_path / "release"
    size = 10 << 20
    payload = (LOOKALIKE + "dddd abcd " * (size // 10))[:size].encode()
    prog = ("import os, sys, time\n"
            f"sys.stdout.write(({LOOKALIKE!r} + 'dddd abcd ' * {size // 10})[:{size}]); sys.stdout.flush()\n"
            f"end = time.time() + 90\nwhile not os.path.exists({str(release)!r}) and time.time() < end: time.sleep(0.05)\n")
    proc = subprocess.Popen([DTRUN, "--mpirun", MPICH, "-np", "1", PYTHON, "-S", "-c", prog], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=user_env(), cwd=REPO, stdin=subprocess.DEVNULL)
    got = b""
    try:
        deadline = time.monotonic() + 90
        while len(got) < len(payload) and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                got += os.read(proc.stdout.fileno(), 1 << 20)
        arrived_while_running = len(got)
        release.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert arrived_while_running == len(payload), (arrived_while_running, err[-2000:])
    assert proc.returncode == 0, err[-2000:]
    assert got + out == payload + b"\n"


# ---- item 9: a program that prints the markers' text ---------------------------------------

FAKE = "0123456789abcdef"
LOOKALIKE_LINES = {
    "stdout": ["dtrun-rank-eof: rank=0", f"dtrun-rank-eof: token={FAKE} rank=0", "[1,0]<stdout>: dtrun-rank-eof: rank=1",
               "dtrun-rank-start: rank=7 host=elsewhere", "dtrun-rank-exit: rank=0 host=elsewhere code=3"],
    "stderr": ["dtrun-rank-start: rank=7 host=elsewhere", f"dtrun-rank-start: token={FAKE} rank=7 host=elsewhere",
               "dtrun-rank-exit: rank=0 host=elsewhere code=3 t=1.000000",
               f"dtrun-rank-exit: token={FAKE} rank=0 host=elsewhere signal=9 forwarded=0",
               "dtrun-rank-exit: rank=0 host=elsewhere code=127 t=1.0 start-error=command not found; program=x",
               "dtrun-rank-eof: rank=0"],
}
PRINTER = ("import os, sys\n"
           "print(*{out!r}, sep='\\n', flush=True)\n"
           "print(*{err!r}, sep='\\n', file=sys.stderr, flush=True)\n"
           "print('token seen by the program:', os.environ.get('DTRUN_MARKER_TOKEN'), flush=True)\n"
           "sys.stdout.write('no newline then ' + {glued!r}); sys.stdout.flush()\n"
           "sys.exit(int(os.environ.get('EXIT_' + os.environ['DTRUN_RANK'], '0')))\n").format(
    out=LOOKALIKE_LINES["stdout"], err=LOOKALIKE_LINES["stderr"], glued="dtrun-rank-eof: rank=0")


@pytest.mark.parametrize("mpirun", ["openmpi", "mpich"])
def test_marker_text_printed_by_the_program_passes_through(mpirun):
    """Each marker's text, without the job's token or with a made-up one, on stdout and stderr:
    every line arrives unchanged, and none of them is taken for a rank's start, end or exit."""
    args = ["--mpirun", MPICH] if mpirun == "mpich" else []
    if mpirun == "mpich" and not os.path.exists(MPICH):
        pytest.skip(f"{MPICH} not installed (Debian mpich)")
    p = dtrun(*args, "-np", "1", "--no-tag-output", PYTHON, "-S", "-c", PRINTER, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "\n".join(LOOKALIKE_LINES["stdout"]) + "\ntoken seen by the program: None\n" \
                       "no newline then dtrun-rank-eof: rank=0\n"
    for line in LOOKALIKE_LINES["stderr"]:
        assert f"{line}\n" in p.stderr, p.stderr
    assert "job failed" not in p.stderr and "did not arrive" not in p.stderr


def test_failure_summary_still_names_the_rank_that_failed_among_lookalikes():
    p = dtrun("-np", "2", "-x", "EXIT_1=5", PYTHON, "-S", "-c", PRINTER, timeout=120)
    assert p.returncode == 5, p.stderr
    assert f"dtrun: job failed: rank 1 on {HOST} exited with code 5" in p.stderr, p.stderr
    assert p.stdout.count("dtrun-rank-eof: rank=0\n") == 2 * 2  # each rank's own line and its glued one


def test_markers_need_the_jobs_token():
    token = "f00dfeedcafe1234"
    signed = f"dtrun-rank-exit: token={token} rank=2 host=h3 code=7 t=5.0"
    assert parse_marker(signed, token).code == 7
    assert parse_marker(signed.replace(token, FAKE), token) is None
    assert parse_marker("dtrun-rank-exit: rank=2 host=h3 code=7", token) is None
    assert parse_start_marker(f"dtrun-rank-start: token={token} rank=1 host=h2", token) == ("1", "h2")
    assert parse_start_marker("dtrun-rank-start: rank=1 host=h2", token) is None
    seen = set()
    text = f"a\ndtrun-rank-eof: rank=0\nb dtrun-rank-eof: token={token} rank=3\n[1,2]<stdout>: dtrun-rank-eof: token={token} rank=2\n"
    assert split_eof_markers(text, seen, token) == ("a\ndtrun-rank-eof: rank=0\nb \n", "") and seen == {"2", "3"}


# ---- item 14: name the launcher that ran ---------------------------------------------------

def test_summary_names_the_launcher():
    from dtrun.launcher.job.result import launcher_name

    assert launcher_name(["env", "NCCL_SOCKET_IFNAME=^lo,docker0", "/usr/bin/srun", "--ntasks=2"]) == "srun"
    assert launcher_name(["/usr/bin/mpiexec.hydra", "-n", "2"]) == "mpiexec.hydra"
    srun = JobResult(returncode=137, mpirun_returncode=137, launcher="srun")
    assert failure_summary(srun) == "dtrun: job failed: srun exited with code 137"
    killed = JobResult(returncode=137, mpirun_returncode=-9, launcher="mpiexec.hydra")
    assert failure_summary(killed) == "dtrun: job failed: mpiexec.hydra was killed by SIGKILL"
    stopped = JobResult(returncode=130, mpirun_returncode=0, launcher="srun",
                        stops=[StopState(StopReason.SIGNAL, "stopped by SIGINT", 2)])
    assert failure_summary(stopped) == "dtrun: stopped by SIGINT; srun stopped the job on every host"


@pytest.mark.flavor
@pytest.mark.mpi
def test_mpich_failure_names_mpiexec():
    """A rank's wrapper killed before it can report: the summary names MPICH's mpiexec, not mpirun."""
    if not os.path.exists(MPICH):
        pytest.skip(f"{MPICH} not installed (Debian mpich)")
    p = dtrun("--mpirun", MPICH, "-np", "2", "sh", "-c", "kill -9 $PPID", timeout=120)
    assert p.returncode == 9, p.stderr
    assert "dtrun: job failed: mpiexec.mpich exited with code 9" in p.stderr.splitlines(), p.stderr


@pytest.fixture(scope="module")
def slurm():
    from tests.cluster_plugin import _terminate_gracefully, skip_if_unavailable
    from tests.nscluster import Cluster
    from tests.slurmcluster import SlurmCluster, slurm_unavailable_reason

    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(f"Slurm test cluster unavailable: {reason}")
    skip_if_unavailable()
    _terminate_gracefully()
    ns = Cluster(2, faults={i: {"dead"} for i in range(2)}).up()  # no sshd: Slurm starts everything
    try:
        with SlurmCluster(ns) as cluster:
            yield cluster
    finally:
        ns.down()


@pytest.mark.cluster
@pytest.mark.mpi
def test_srun_failure_names_srun(slurm):
    """Inside salloc dtrun runs the ranks with srun: a step that fails without a rank's report
    (the wrapper killed) is "srun exited with code N", not mpirun."""
    env = slurm.env(DTRUN_SLURM_POLL_S="1")
    env["PATH"] = f"{os.path.dirname(DTRUN)}{os.pathsep}{env.get('PATH', '')}"
    env.pop("OMPI_ALLOW_RUN_AS_ROOT", None)
    argv = slurm.head_argv(["salloc", "-N2", "-n2", DTRUN, "--launcher", "srun", "sh", "-c", "kill -9 $PPID"])
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=REPO, stdin=subprocess.DEVNULL)
    m = re.search(r"^dtrun: job failed: (\S+) exited with code (\d+)$", p.stderr, re.M)
    assert m and m.group(1) == "srun", p.stderr
    assert p.returncode == int(m.group(2)) != 0, p.stderr
