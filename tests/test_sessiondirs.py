"""Open MPI 5 session directories left by killed jobs (launcher/remote/sessiondirs.py).

PMIx 5.0 refuses to start an mpirun or prted whose pid a stale session directory names
("The PMIx server's listener thread failed to start", mpirun exit 213). CI met it: a
hang test's job died at start-up because an earlier, killed job's directory had its pid.
These tests make that collision happen with the real mpirun, then show dtrun launching
through it, and each place that sweeps (the launching host, each host's rank wrapper,
the kill agent) removing exactly the stale directories.
"""
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from dtrun.launcher.remote import agent as remote_agent, sessiondirs
from dtrun.launcher.remote.procfs import proc_start
from tests.dtrun_helpers import BIN, DTRUN, PYTHON, REPO, started, user_env

MPIRUN = str(BIN / "mpirun")
HOST = socket.gethostname()
RANKEXEC = str(REPO / "launcher" / "remote" / "rankexec.py")


def openmpi5() -> bool:
    try:
        out = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return False
    return "Open MPI) 5." in out


needs_ompi5 = pytest.mark.skipif(not openmpi5(), reason="the bundled mpirun is not Open MPI 5")


def make_stale(top, name, pid, recorded=None, host=HOST, lock=True):
    """A session directory as a killed Open MPI 5 process of a dtrun job leaves it: NAME.PID
    with PMIx's rendezvous files, whose third line is the pid, and (``lock``) dtrun's lock
    file, which nobody holds any more."""
    d = os.path.join(str(top), f"{name}.{pid}")
    os.makedirs(d, exist_ok=True)
    text = f"prterun-{host}-{pid}@0.0;tcp4://127.0.0.1:1\n5.0.11\n{recorded or pid}\n0:0\nThu Jan  1 00:00:00 1970\n"
    for f in (f"pmix.{host}.tool", f"pmix.{host}.tool.{pid}"):
        with open(os.path.join(d, f), "w") as fh:
            fh.write(text)
    if lock:
        open(os.path.join(d, "dtrun.lock"), "w").close()  # sessiondirs.LOCK_NAME
    return d


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_only_dead_owned_pmix_session_dirs_are_removed(tmp_path):
    gone = dead_pid()
    stale = make_stale(tmp_path, "prted", gone)
    stale2 = make_stale(tmp_path, "ompi", dead_pid())
    live = make_stale(tmp_path, "ompi", os.getpid())  # a running process's session: kept
    other = make_stale(tmp_path, "prted", dead_pid(), recorded=os.getpid())  # not written by that pid
    plain = tmp_path / f"build.{dead_pid()}"  # no rendezvous file: not a PMIx session
    plain.mkdir()
    (plain / "pmix.notes").write_text("a\nb\nc\n")
    afile = tmp_path / f"ompi.{dead_pid()}"  # a file, not a directory
    afile.write_text("x")
    target = make_stale(tmp_path / "elsewhere", "ompi", gone)
    link = tmp_path / f"ompi.{dead_pid()}"
    link.symlink_to(target)  # a symlink is never followed
    foreign = make_stale(tmp_path, "prted", dead_pid())
    os.chown(foreign, 65534, 65534)  # someone else's: kept
    odd = [make_stale(tmp_path, "ompi", p) for p in (0, 1)]
    assert sorted(sessiondirs.stale(str(tmp_path))) == sorted([stale, stale2])
    removed = sessiondirs.sweep({"TMPDIR": str(tmp_path)})
    assert sorted(removed) == sorted([stale, stale2])
    for kept in (live, other, plain, afile, link, target, foreign, *odd):
        assert os.path.lexists(kept), kept
    assert not os.path.exists(stale) and not os.path.exists(stale2)


def test_a_dead_session_dir_without_our_lock_file_is_kept(tmp_path):
    """Its pid is gone here, but without dtrun's lock file nothing proves it dead: a bare
    mpirun's, or one of another pid namespace sharing this /tmp (where its pid lives)."""
    bare = make_stale(tmp_path, "ompi", dead_pid(), lock=False)
    ours = make_stale(tmp_path, "prted", dead_pid())
    assert sessiondirs.stale(str(tmp_path)) == [ours]
    assert sessiondirs.sweep({"TMPDIR": str(tmp_path)}) == [ours]
    assert os.path.isdir(bare) and not os.path.exists(ours)


def test_top_dir_follows_prrte_order():
    assert sessiondirs.top_dir({"TMPDIR": "/a", "TEMP": "/b", "TMP": "/c"}) == "/a"
    assert sessiondirs.top_dir({"TMPDIR": "", "TEMP": "/b", "TMP": "/c"}) == "/b"
    assert sessiondirs.top_dir({"TMP": "/c"}) == "/c"
    assert sessiondirs.top_dir({}) == "/tmp"


@pytest.mark.mpi
@needs_ompi5
def test_bare_mpirun_refuses_a_pid_that_a_stale_session_dir_names(tmp_path):
    """The failure itself, with the real mpirun: what dtrun has to prevent."""
    script = (f"{PYTHON} -c 'import sys; sys.path.insert(0, sys.argv[1]); import tests.test_sessiondirs as t; "
              f"t.make_stale(sys.argv[2], \"ompi\", int(sys.argv[3]))' {REPO} {tmp_path} $$ && "
              f"exec {MPIRUN} --allow-run-as-root -np 1 true")
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                       env=user_env(TMPDIR=str(tmp_path)))
    assert p.returncode == 213, p.stderr
    assert "listener thread failed to start" in p.stderr


def _next_pids(n):
    """The next ``n`` pids the kernel will hand out (wrapping at pid_max), live ones left out."""
    last = int(open("/proc/sys/kernel/ns_last_pid").read())
    top = int(open("/proc/sys/kernel/pid_max").read())
    out = []
    for i in range(1, n + 1):
        p = last + i
        if p >= top:
            p = 300 + (p - top)  # Linux starts again above the first 300 pids
        if not sessiondirs.alive(p):
            out.append(p)
    return out


@pytest.mark.mpi
@needs_ompi5
def test_dtrun_launches_where_stale_dirs_name_the_next_pids(tmp_path):
    """Stale directories for every pid the next 3000 processes will get: dtrun's mpirun gets
    one of them (asserted), and the job runs because dtrun removed them first."""
    pids = _next_pids(3000)
    for p in pids:
        make_stale(tmp_path, "ompi", p)
    prog = ("import os\n"
            "wrapper = os.getppid()\n"
            "stat = open(f'/proc/{wrapper}/stat').read()\n"
            "print('MPIRUN', stat[stat.rfind(')') + 2:].split()[1])\n"  # the wrapper's parent: mpirun
            "from mpi4py import MPI\n"
            "print('SUM', MPI.COMM_WORLD.allreduce(1))\n")
    p = subprocess.Popen([DTRUN, "-np", "2", "python", "-c", prog], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=user_env(TMPDIR=str(tmp_path)), cwd=REPO, stdin=subprocess.DEVNULL)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert sorted(l.split("SUM", 1)[1] for l in out.splitlines() if "SUM" in l) == [" 2", " 2"], out
    mpirun_pid = {int(l.split("MPIRUN")[1]) for l in out.splitlines() if "MPIRUN" in l}
    assert len(mpirun_pid) == 1 and mpirun_pid <= set(pids), (mpirun_pid, pids[0], pids[-1])
    # Gone but those whose pid a live process had at dtrun's sweeps (dtrun's own; on a busy
    # machine, others': they are kept, rightly).
    left = [q for q in pids if os.path.lexists(tmp_path / f"ompi.{q}")]
    assert p.pid in left and len(left) < len(pids) // 10, f"{len(left)} stale directories left, e.g. {left[:5]}"


@pytest.mark.mpi
@needs_ompi5
def test_rank_wrapper_sweeps_its_host(tmp_path):
    """Local rank 0's wrapper removes the host's stale directories during the job (what keeps
    remote hosts clean); a job without the wrapper leaves them."""
    env = user_env(TMPDIR=str(tmp_path))
    prog = [PYTHON, "-c", "import time; time.sleep(1.5)"]
    bare = make_stale(tmp_path, "prted", dead_pid())
    p = subprocess.run([MPIRUN, "--allow-run-as-root", "-np", "2", *prog], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert os.path.isdir(bare), "mpirun itself removed a stale directory: the wrapper's sweep proves nothing"
    p = subprocess.run([MPIRUN, "--allow-run-as-root", "-np", "2", sys.executable, "-S", RANKEXEC, "--", *prog],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert not os.path.exists(bare)


def test_kill_agent_sweeps_what_the_daemons_it_killed_left(tmp_path):
    """The kill agent (dtrun stopping a job) SIGKILLs a job's MPI daemon, which leaves its session
    directory; the agent removes it once the daemon is gone, and nothing live."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    daemon = started(["sleep", "60"], env={**os.environ, "DTRUN_JOB_DIR": str(job_dir)})  # proven the job's
    threading.Thread(target=daemon.wait, daemon=True).start()  # its parent reaps it, as sshd would
    name, start = proc_start(daemon.pid)
    (job_dir / f"daemon.{daemon.pid}.json").write_text(
        json.dumps({"host": HOST, "pid": daemon.pid, "name": name, "start": start}))
    top = tmp_path / "tmp"
    left = make_stale(top, "prted", daemon.pid)
    live = make_stale(top, "ompi", os.getpid())
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(top)
    try:
        out = remote_agent.kill(str(job_dir))
    finally:
        if old is None:
            os.environ.pop("TMPDIR")
        else:
            os.environ["TMPDIR"] = old
    assert out["killed"] == [daemon.pid] and out["swept"] == 1, out
    assert daemon.wait(timeout=5) == -9
    assert not os.path.exists(left) and os.path.isdir(live)


@pytest.mark.cluster
@pytest.mark.mpi
@needs_ompi5
def test_a_remote_daemon_refused_for_a_stale_dir_gets_the_note(cluster3, tmp_path):
    """On another host dtrun cannot sweep before the launch: there the failure is explained,
    naming the host.
    dtrun's own temporary directory is elsewhere, so the namespace hosts' /tmp is not swept
    first; their prted gets one of the pids the stale directories name."""
    host = cluster3.hosts[1].name
    pids = _next_pids(3000)
    # Without dtrun's lock file, as a bare mpirun's: no sweep (another job's here) removes them first.
    made = [make_stale("/tmp", "prted", p, host=host, lock=False) for p in pids]
    try:
        p = subprocess.run([DTRUN, "--ssh-config", str(cluster3.ssh_config), "-H", f"{host}:1", "python", "-c",
                            "print('ran')"], capture_output=True, text=True, timeout=120,
                           env=user_env(TMPDIR=str(tmp_path)), cwd=REPO, stdin=subprocess.DEVNULL)
    finally:
        for d in made:
            if not sessiondirs.alive(int(d.rsplit(".", 1)[1])):
                subprocess.run(["rm", "-rf", d])
    assert p.returncode != 0 and "ran" not in p.stdout, (p.stdout, p.stderr)
    assert "Daemon exit status: 213" in p.stdout  # mpirun's report; the daemon's own words are lost
    assert f"dtrun: warning: Open MPI's PMIx would not start on {host} and no rank started" in p.stderr
    assert "(ompi.PID, prted.PID)" in p.stderr and "run the job again" in p.stderr


def test_the_probe_reports_its_hosts_stale_session_dirs(tmp_path):
    """The doctor's probe, started as on any host (the same program, stdin and JSON), finds them."""
    from dtrun.checks import probesession

    stale = make_stale(tmp_path, "prted", dead_pid())
    make_stale(tmp_path, "ompi", os.getpid())
    p = subprocess.run(["/bin/sh", "-c", probesession.boot_command(PYTHON)], input=probesession.probe_input({"gpu": False}),
                       capture_output=True, timeout=60, env=user_env(TMPDIR=str(tmp_path)))
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout.splitlines()[0])
    assert rep["stale_sessions"] == {"count": 1, "paths": [stale]}


@pytest.mark.cluster
def test_doctor_names_the_host_and_how_to_remove_them(cluster3):
    """The namespace hosts share this machine's /tmp, so every remote host reports the same one."""
    d = make_stale("/tmp", "prted", dead_pid(), host=cluster3.hosts[1].name)
    try:
        p = subprocess.run([DTRUN, "doctor", "--json", "--no-e2e", "--ssh-config", str(cluster3.ssh_config),
                            "--hostfile", str(cluster3.hostfile)], capture_output=True, text=True, timeout=120,
                           env=user_env(), cwd=REPO, stdin=subprocess.DEVNULL)
    finally:
        subprocess.run(["rm", "-rf", d])
    assert p.returncode in (0, 1), p.stderr
    assert p.stdout.startswith("{"), p.stderr[-2000:]  # the JSON report, not a traceback
    found = [f for f in json.loads(p.stdout)["findings"] if "session directory of killed Open MPI 5" in f["detail"]]
    hosts = [h.name for h in cluster3.hosts]
    assert sorted(f["host"] for f in found) == sorted(hosts), p.stdout
    for f in found:
        assert f["status"] == "warn" and f"1 session directory of killed Open MPI 5 jobs on {f['host']} ({d})" \
            in f["detail"], f
        assert f"to remove them now: ssh {f['host']} rm -rf {d}" in f["fix"], f
