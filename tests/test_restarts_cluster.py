"""Restarts across real hosts (``--max-restarts``, ``--spares``, ``--min-np``, ``--on-hang restart``).

Real faults on network-namespace hosts: a rank killed by SIGKILL, a host lost mid-run
(every process in its namespace killed and all its traffic dropped, as a crashed node),
a script bug, a hang, and Ctrl-C while dtrun relaunches. The job is
examples/train_resume.py, which resumes from its checkpoint; its final weights must be
those of a run that never failed.
"""
import os
import re
import signal
import subprocess
import time

import pytest

from tests import nscluster
from tests.dtrun_helpers import (DTRUN, PYTHON, REPO, command_lines, dtrun, finish, module_cluster, processes_with,
                                 user_env, wait_until_empty)

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

EXAMPLE = str(REPO / "examples" / "train_resume.py")


def host_list(hosts, slots=1):
    return ",".join(f"{h.name}:{slots}" for h in hosts)


def final_w(stdout):
    found = re.findall(r"^final w (.+)$", stdout, re.M)
    assert len(found) == 1, stdout[-2000:]
    return found[0]


def reference_w(tmp_path, np_):
    """The final weights of a run with ``np_`` ranks that never failed (on this machine)."""
    p = dtrun("-np", np_, "--oversubscribe", "--no-tag-output", PYTHON, EXAMPLE, "--checkpoint",
              tmp_path / f"ref{np_}.ckpt", timeout=120)
    assert p.returncode == 0, p.stderr
    return final_w(p.stdout)


def start(cluster, *args):
    argv = [DTRUN, "--ssh-config", str(cluster.ssh_config), "--no-tag-output", *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=user_env(),
                            cwd=REPO, stdin=subprocess.DEVNULL)


def read_until(stream, pattern, timeout=90):
    """Lines of ``stream`` up to the first that matches ``pattern`` (fails when it does not come)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return seen
    raise AssertionError(f"{pattern!r} did not come:\n" + "".join(seen[-40:]))


def lose(host, silent_first=False):
    """The host dies: every process of its namespace killed (sshd, MPI daemons, ranks) and all
    its traffic dropped. Killed first, its connections close as a crashed kernel's or an OOM
    kill's would (MPI notices at once); silenced first (``silent_first``), nothing more comes
    from it, as from a host that lost power (only a timeout notices)."""
    def drop():
        for chain in ("INPUT", "OUTPUT"):
            subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-I", chain, "-j", "DROP"], check=True,
                           capture_output=True, timeout=30)

    if silent_first:
        drop()
    killed = nscluster._netns_pids(host.netns)
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if not silent_first:
        # A killed process closes its sockets as it exits, after the signal is sent: drop the
        # traffic only once each is gone (or a zombie, its files closed), or its FIN may be
        # dropped and the crash looks like a power loss (only a timeout would notice).
        _wait_exited(killed)
        drop()


def _wait_exited(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                        break
            except OSError:
                break  # gone
            time.sleep(0.005)


def revive(cluster, host):
    for chain in ("INPUT", "OUTPUT"):
        subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-D", chain, "-j", "DROP"],
                       capture_output=True, timeout=30)
    cluster._start_sshd(host)


def lose_at(cluster, proc, pattern, host, silent_first=False):
    """Once ``proc`` prints a line matching ``pattern``, lose ``host`` (see ``lose``); wait for
    the job's end, then bring the host back. Returns (exit code, stdout, stderr)."""
    try:
        read_until(proc.stdout, pattern)
        lose(host, silent_first)
        return finish(proc, 120)
    finally:
        revive(cluster, host)


@pytest.fixture(scope="module")
def cluster4():
    """Four hosts for the tests that lose one; each test brings its host back."""
    yield from module_cluster(4, terminate_strays=True)


# ---- 1. a rank killed on a healthy host ------------------------------------------------------

def test_killed_rank_is_retried_on_the_same_hosts_and_resumes_exactly(cluster3, tmp_path):
    want = reference_w(tmp_path, 3)
    hosts = cluster3.hosts
    p = start(cluster3, "-H", host_list(hosts), "--max-restarts", "2", "--log-dir", tmp_path / "logs",
              PYTHON, EXAMPLE, "--checkpoint", tmp_path / "ckpt", "--crash-at", "12")
    rc, out, err = finish(p, 120)
    assert rc == 0, err
    names = [h.name for h in hosts]
    if f"dtrun: job failed: rank 2 on {names[2]} killed by SIGKILL" in err:
        cause = f"rank 2 on {names[2]} killed by SIGKILL"
    else:
        # Open MPI 5 can drop the killed rank's report when a peer's abort tears the job down
        # at the same moment (2 jobs of 69 back to back here, 4 of 22 under load; launching.md says so).
        # Then a peer that lost its connection is named, and the killed rank is not counted at
        # all: had its report arrived and been filed under the tear-down (the rank wrapper's
        # forwarded flag, test_lifecycle), it would be "2 other ranks stopped too".
        peer = re.search(r"^dtrun: job failed: (rank ([01]) on (\S+) exited with code 14)"
                         r"(?: \(1 other rank stopped too\))?$", err, re.M)
        assert peer and peer.group(3) == names[int(peer.group(2))], err
        cause = peer.group(1)
        assert "Socket closed" in err or "unexpectedly disconnected" in err, err
    assert (f"dtrun: attempt 2 of 3: {cause}; every host passed the check; "
            f"3 ranks on {', '.join(names)}") in err, err
    # one log directory per attempt, DIR/latest the last one
    runs = sorted(d.name for d in (tmp_path / "logs").iterdir() if d.name != "latest")
    assert [r.rsplit("-", 2)[1:] for r in runs] == [["attempt", "1"], ["attempt", "2"]], runs
    assert os.readlink(tmp_path / "logs" / "latest") == runs[1]
    first, second = ((tmp_path / "logs" / r / "rank.0.log").read_text() for r in runs)
    assert "attempt 0: 3 ranks, no checkpoint" in first and "final w" not in first
    assert "attempt 1: 3 ranks, resumed from step 10" in second
    assert final_w(second) == want


# ---- 2. a host lost mid-run -------------------------------------------------------------------

def test_lost_host_is_left_out_and_a_spare_takes_its_place(cluster4, tmp_path):
    """A host that goes silent (power lost): only the hang watchdog notices, and nothing names the
    host; the check does, with its quick bound, as the spare lets the run go on without it."""
    want = reference_w(tmp_path, 3)
    a, b, c, d = cluster4.hosts
    p = start(cluster4, "-H", host_list(cluster4.hosts), "-np", "3", "--max-restarts", "2",
              "--hang-timeout", "4", "--on-hang", "restart",
              PYTHON, EXAMPLE, "--checkpoint", tmp_path / "ckpt", "--steps", "30", "--step-time", "0.2")
    rc, out, err = lose_at(cluster4, p, r"^step 6 ", b, silent_first=True)
    assert rc == 0, err
    assert re.search(rf"dtrun: host {b.name} was lost: ssh: TCP to {b.name} \(\S+\) timed out after 2 s; "
                     r"rank 1 was on it", err), err
    assert re.search(rf"dtrun: attempt 2 of 3: {b.name} left out \(ssh: TCP to {b.name} \(\S+\) timed out after "
                     rf"2 s\); no progress \(--hang-timeout\); 3 ranks on {a.name}, {c.name}, {d.name} \(spare\)$",
                     err, re.M), err
    assert re.search(r"attempt 1: 3 ranks, resumed from step \d+", out), out
    assert final_w(out) == want


# What the failure itself says of a host that crashed (launcher/restarts.py lost_hosts): Open MPI
# names the daemon it lost, or only ssh says the host closed the daemon's connection (either happens).
CRASH_EVIDENCE = r"(its MPI daemon was lost|it closed its MPI daemon's ssh connection|its rank went silent)"


def test_crashed_host_is_left_out_on_the_failures_evidence_without_an_ssh_check(cluster4, tmp_path):
    """A host that crashes (its connections close) while a spare waits: the failure names it, so
    it is left out at once, never waited on for the ssh check's timeout, and nothing of the
    job is left running anywhere afterwards."""
    want = reference_w(tmp_path, 3)
    a, b, c, d = cluster4.hosts
    token = f"hre-crash-{os.getpid()}-{time.monotonic_ns()}"
    p = start(cluster4, "-H", host_list(cluster4.hosts), "-np", "3", "--max-restarts", "1",
              PYTHON, EXAMPLE, "--checkpoint", tmp_path / f"{token}.ckpt", "--steps", "30", "--step-time", "0.2")
    rc, out, err = lose_at(cluster4, p, r"^step 6 ", b)
    assert rc == 0, err
    assert re.search(rf"^dtrun: host {b.name} was lost: {CRASH_EVIDENCE}; rank 1 was on it$", err, re.M), err
    assert re.search(rf"^dtrun: attempt 2 of 2: {b.name} left out \({CRASH_EVIDENCE}\); .+; "
                     rf"3 ranks on {a.name}, {c.name}, {d.name} \(spare\)$", err, re.M), err
    assert "timed out" not in err, err
    assert re.search(r"attempt 1: 3 ranks, resumed from step \d+", out), out
    assert final_w(out) == want
    # dtrun has exited: the ranks are gone, and so are its agents, the lost host's included
    # (their clean-up there ran on in the background, and ended before dtrun did)
    assert wait_until_empty(lambda: processes_with(token), timeout=10) == []
    agents = command_lines(lambda cmd: "agent.py" in cmd and str(cluster4.ssh_config) in cmd)
    assert agents == [], agents


def test_lost_host_with_min_np_goes_on_with_fewer_ranks(cluster4, tmp_path):
    """A host that crashes (its connections close): MPI ends the job, saying it lost a daemon or just
    exiting 255 (either happens); no spare is left, and --min-np lets 2 ranks go on without the
    host, which the failure's evidence names."""
    a, b, c, _ = cluster4.hosts
    p = start(cluster4, "-H", host_list([a, b, c]), "--max-restarts", "1", "--min-np", "2",
              PYTHON, EXAMPLE, "--checkpoint", tmp_path / "ckpt", "--steps", "40", "--step-time", "0.2")
    rc, out, err = lose_at(cluster4, p, r"^step 6 ", c)
    assert rc == 0, err
    assert re.search(rf"dtrun: attempt 2 of 2: {c.name} left out \({CRASH_EVIDENCE}\); "
                     rf".+; 2 ranks on {a.name}, {b.name}$",
                     err, re.M), err
    assert re.search(r"attempt 1: 2 ranks, resumed from step \d+", out), out
    assert "final w" in out


def test_lost_host_is_named_without_restarts(cluster4, tmp_path):
    a, b, _, _ = cluster4.hosts
    p = start(cluster4, "-H", host_list([a, b]), PYTHON, EXAMPLE, "--checkpoint", tmp_path / "ckpt",
              "--steps", "200", "--step-time", "0.2")
    rc, out, err = lose_at(cluster4, p, r"^step 3 ", b)
    assert rc != 0, err
    lines = [line for line in err.splitlines() if " was lost: " in line]
    assert len(lines) == 1 and re.fullmatch(
        rf"dtrun: host {b.name} was lost: ssh: TCP to {b.name} \(\S+\) timed out after 5 s; rank 1 was on it",
        lines[0]), err
    assert "attempt 2" not in err


# ---- 3. a script bug --------------------------------------------------------------------------

def test_same_exception_twice_on_healthy_hosts_stops_after_two_attempts(cluster3, tmp_path):
    bug = tmp_path / "bug.py"
    bug.write_text("from mpi4py import MPI\nc = MPI.COMM_WORLD\nc.Barrier()\n"
                   "if c.rank == 1:\n    raise KeyError('learning_rate')\nc.Barrier()\n")
    p = dtrun("--ssh-config", cluster3.ssh_config, "-H", host_list(cluster3.hosts), "--max-restarts", "5",
              PYTHON, bug, timeout=180)
    assert p.returncode == 1, p.stderr
    assert p.stderr.count("KeyError: 'learning_rate'") == 2, p.stderr
    assert "dtrun: attempt 2 of 6:" in p.stderr and "attempt 3 of 6" not in p.stderr
    assert re.search(rf"dtrun: not restarting: the same failure twice in a row \(rank 1 on {cluster3.hosts[1].name} "
                     rf"exited with code 1 \(KeyError at {re.escape(str(bug))}:5\)\) while every host passed the check",
                     p.stderr), p.stderr


# ---- 4. a hang ----------------------------------------------------------------------------------

def test_hang_with_on_hang_restart_restarts_and_finishes(cluster3, tmp_path):
    want = reference_w(tmp_path, 3)
    p = dtrun("--ssh-config", cluster3.ssh_config, "-H", host_list(cluster3.hosts), "--max-restarts", "1",
              "--hang-timeout", "4", "--on-hang", "restart", "--no-tag-output",
              PYTHON, EXAMPLE, "--checkpoint", tmp_path / "ckpt", "--hang-at", "8", timeout=180)
    assert p.returncode == 0, p.stderr
    assert "dtrun: --on-hang restart: stopping the job" in p.stderr
    assert "(--on-hang restart)" in p.stderr and "--on-hang abort" not in p.stderr, p.stderr
    assert re.search(r"dtrun: attempt 2 of 2: no progress \(--hang-timeout\); every host passed the check; "
                     r"3 ranks on ", p.stderr), p.stderr
    assert "attempt 1: 3 ranks, resumed from step 5" in p.stdout
    assert final_w(p.stdout) == want


# ---- 5. restarts used up ------------------------------------------------------------------------

def test_restarts_exhausted_exit_with_the_documented_code(cluster3, tmp_path):
    # a different rank dies on every attempt: never the same failure twice
    prog = tmp_path / "flaky.py"
    prog.write_text("import os, signal\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\nc.Barrier()\n"
                    "if c.rank == int(os.environ['DTRUN_RESTART_COUNT']) % c.size:\n"
                    "    os.kill(os.getpid(), signal.SIGKILL)\nc.Barrier()\n")
    p = dtrun("--ssh-config", cluster3.ssh_config, "-H", host_list(cluster3.hosts), "--max-restarts", "1",
              PYTHON, prog, timeout=180)
    assert p.returncode == 123, p.stderr
    # the last cause as dtrun saw it: rank 1's kill, or (under load) what mpirun reported instead
    assert re.search(r"^dtrun: not restarting: all 2 attempts \(--max-restarts 1\) failed; the last: .+ "
                     r"\(exit code 123\)$", p.stderr, re.M), p.stderr


# ---- 6. Ctrl-C while dtrun relaunches -------------------------------------------------------------

def test_ctrl_c_during_a_relaunch_stops_everything(cluster3, tmp_path):
    token = f"hre-ctrlc-{os.getpid()}-{time.monotonic_ns()}"
    prog = tmp_path / f"{token}.py"
    prog.write_text("import os, time\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\nc.Barrier()\n"
                    "if os.environ['DTRUN_RESTART_COUNT'] == '0' and c.rank == 2:\n    raise SystemExit(7)\n"
                    "time.sleep(300)\n")
    p = start(cluster3, "-H", host_list(cluster3.hosts), "--max-restarts", "3", PYTHON, prog)
    try:
        read_until(p.stderr, r"^dtrun: attempt 2 of 4: ")
        time.sleep(0.5)  # the relaunch is under way (preflight, mpirun starting its daemons)
        p.send_signal(signal.SIGINT)
        rc, _, err = finish(p, 60)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 130, err
    assert "attempt 3" not in err
    assert wait_until_empty(lambda: processes_with(token), timeout=15) == []


# ---- 7. the run's ssh connections ------------------------------------------------------------------

def _masters(hosts):
    """(pid, command line) of the ssh master connections to ``hosts`` (launcher/sshmux.py)."""
    names = {h.name for h in hosts}
    return command_lines(lambda cmd: cmd.startswith("ssh ") and "ControlMaster=yes" in cmd
                         and any(f" {n} " in cmd for n in names))


def test_a_restart_starts_its_daemons_through_the_runs_ssh_connections_which_end_with_the_run(cluster3, tmp_path):
    """Under --max-restarts dtrun keeps one ssh connection per host: the next attempt's mpirun
    starts its daemons through them (a new ssh connection each would cost a recovery seconds at
    16 hosts), and none of them, nor their sockets' directory, is left once dtrun has exited."""
    hosts = cluster3.hosts
    p = start(cluster3, "-H", host_list(hosts), "--max-restarts", "1", PYTHON, EXAMPLE, "--checkpoint",
              tmp_path / "ckpt", "--crash-at", "6", "--steps", "40", "--step-time", "0.2")
    try:
        read_until(p.stdout, r"^attempt 1: 3 ranks, resumed from step")
        masters = _masters(hosts)
        daemons = command_lines(lambda cmd: "ControlMaster=no" in cmd and "prted" in cmd)
        folders = {re.search(r"ControlPath=(\S+)/%C", cmd).group(1) for _, cmd in masters}
        modes = {oct(os.stat(f).st_mode & 0o777) for f in folders}
        rc, out, err = finish(p, 120)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 0, err
    assert sorted(next(h.name for h in hosts if f" {h.name} " in cmd) for _, cmd in masters) == \
        sorted(h.name for h in hosts), masters
    assert len(folders) == 1 and modes == {"0o700"}, (masters, modes)
    folder = folders.pop()
    # the second attempt's daemons: one ssh session per host, each through the run's connection
    assert len(daemons) == 3 and all(f"ControlPath={folder}/%C" in cmd for _, cmd in daemons), daemons
    assert wait_until_empty(lambda: _masters(hosts), timeout=10) == []
    assert not os.path.exists(folder)


def test_the_runs_ssh_connections_end_when_dtrun_is_killed(cluster3, tmp_path):
    """SIGKILL leaves dtrun no time to close its ssh connections: each ends by itself, as its
    remote command reads the input whose other end only dtrun held."""
    hosts = cluster3.hosts
    token = f"hre-mux-{os.getpid()}-{time.monotonic_ns()}"
    p = start(cluster3, "-H", host_list(hosts), "--max-restarts", "1", PYTHON, EXAMPLE, "--checkpoint",
              tmp_path / f"{token}.ckpt", "--steps", "200", "--step-time", "0.2")
    try:
        read_until(p.stdout, r"^step 3 ")
        deadline = time.monotonic() + 20
        while len(_masters(hosts)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_masters(hosts)) == 3, _masters(hosts)
        p.kill()
        p.wait(timeout=10)
        assert wait_until_empty(lambda: _masters(hosts), timeout=15) == []
    finally:
        if p.poll() is None:
            p.kill()
        for proc in processes_with(token):  # the job itself: dtrun was not there to stop it
            try:
                proc.kill()
            except Exception:
                pass


# ---- 8. Open MPI 4.1 and MPICH ----------------------------------------------------------------------

from tests.test_flavors_real import builds  # noqa: E402,F401 (the session fixture: each flavor's options)


@pytest.mark.flavor
@pytest.mark.parametrize("name", ["openmpi4", "mpich"])
def test_restart_under_other_flavors(cluster3, builds, tmp_path, name):  # noqa: F811
    b = builds[name]
    if isinstance(b, str):
        pytest.skip(b)
    ref = dtrun(*b.mpirun_args, "-np", "3", "--oversubscribe", "--no-tag-output", "python", EXAMPLE,
                "--checkpoint", tmp_path / "ref", timeout=120)
    assert ref.returncode == 0, ref.stderr
    names = [h.name for h in cluster3.hosts]
    p = dtrun("--ssh-config", cluster3.ssh_config, *b.mpirun_args, "-H", host_list(cluster3.hosts),
              "--max-restarts", "1", "--no-tag-output", "python", EXAMPLE, "--checkpoint", tmp_path / "ckpt",
              "--crash-at", "8", timeout=180)
    assert p.returncode == 0, p.stderr
    # Hydra may end the job before rank 2's wrapper reports its signal: then mpiexec's code is the cause
    assert re.search(rf"^dtrun: attempt 2 of 2: (rank 2 on {names[2]} killed by SIGKILL|mpirun exited with code \d+); "
                     rf"every host passed the check; 3 ranks on {', '.join(names)}$", p.stderr, re.M), p.stderr
    assert "attempt 1: 3 ranks, resumed from step 5" in p.stdout
    assert final_w(p.stdout) == final_w(ref.stdout)
