"""Recovery after a lost host, the parts that need no cluster: which hosts the failure's own
evidence names as lost (launcher/restarts.py ``lost_hosts``), which of them a restart may
leave out without checking them (``going_on_without``), ssh's own line for a connection the
far end closed, the quick bound of the host check, the rounds of host agents that run on
in the background (launcher/job/kill.py ``AgentRound``) and the observers' ends, all at once
(launcher/job/supervisor.py ``end_observers``)."""
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dtrun.checks import hostcheck
from dtrun.launcher import sshmux
from dtrun.launcher.hostfile import HostSlots
from dtrun.launcher.job import kill
from dtrun.launcher.job.result import JobResult
from dtrun.launcher.job.supervisor import end_observers
from dtrun.launcher.restarts import (ErrorWatch, closed_connections, going_on_without, lost_hosts, slots_left,
                                     ssh_hostname)


def hosts(spec):
    return [HostSlots(name, int(n)) for name, n in (item.split(":") for item in spec.split(","))]


def ended(**kw):
    return JobResult(returncode=kw.pop("returncode", 1), mpirun_returncode=kw.pop("mpirun", 1), **kw)


# ---- what the failure says of the hosts ---------------------------------------------------------

def test_a_lost_daemon_names_its_host():
    assert lost_hosts(ended(lost_daemon_host="h2"), ["h1", "h2", "h3"]) == {"h2": "its MPI daemon was lost"}


def test_a_host_is_named_by_silence_only_when_every_rank_on_it_went_silent():
    r = ended(vanished=[("1", "h2"), ("2", "h2"), ("4", "h3")])
    # rank 3 on h3 was heard from: h3 is not named
    assert lost_hosts(r, ["h1", "h2", "h2", "h3", "h3"]) == {"h2": "all its ranks went silent"}
    assert lost_hosts(ended(vanished=[("1", "h2")]), ["h1", "h2"]) == {"h2": "its rank went silent"}


def test_a_closed_ssh_connection_names_its_host_and_the_daemon_comes_first():
    r = ended(lost_daemon_host="h2")
    assert lost_hosts(r, ["h1", "h2", "h3"], ["h3", "h2"]) == {
        "h2": "its MPI daemon was lost", "h3": "it closed its MPI daemon's ssh connection"}


def test_a_rank_that_failed_names_no_host():
    from dtrun.launcher.job.result import RankFailure

    assert lost_hosts(ended(failures=[RankFailure("1", "h2", code=1)]), ["h1", "h2"]) == {}


def test_ssh_lines_for_a_connection_the_far_end_closed():
    lines = ["Connection to 10.0.0.2 closed by remote host.", "[h1,0]<stderr>: step 6",
             "Connection to 10.0.0.2 closed by remote host.", "1: Connection to hnode3 closed by remote host.",
             "Connection to 10.0.0.4 closed.", "a Connection to 10.0.0.5 closed by remote host."]
    assert closed_connections(lines) == ("10.0.0.2", "hnode3")
    watch = ErrorWatch()
    for line in lines:
        watch.on_output("stderr", (line + "\n").encode())
    watch.on_output("stdout", b"Connection to 10.0.0.9 closed by remote host.\n")
    assert watch.closed() == ("10.0.0.2", "hnode3")


def test_ssh_config_dump_gives_the_hostname():
    assert ssh_hostname("user root\nhostname 10.0.0.2\nport 22\n") == "10.0.0.2"
    assert ssh_hostname("user root\nport 22\n") is None


# ---- whom a restart may leave out without waiting ---------------------------------------------

def test_a_spare_lets_the_run_go_on_without_the_lost_host():
    fits = slots_left(hosts("a:1,b:1,c:1,d:1"), (), (), 3)
    assert going_on_without(["b"], fits) == (["b"], [])
    assert going_on_without(["b", "c"], fits) == (["b"], ["c"])  # one spare: the second host is needed


def test_min_np_lets_the_run_go_on_with_fewer_ranks():
    assert going_on_without(["c"], slots_left(hosts("a:1,b:1,c:1"), (), (), 3, min_np=2)) == (["c"], [])
    assert going_on_without(["c"], slots_left(hosts("a:1,b:1,c:1"), (), (), 3)) == ([], ["c"])


def test_hosts_left_out_before_count():
    fits = slots_left(hosts("a:1,b:1,c:1"), hosts("s:1"), ["a"], 3)
    assert going_on_without(["b"], fits) == ([], ["b"])  # the spare already stands in for a
    fits = slots_left(hosts("a:1,b:1,c:1"), hosts("s1:1,s2:1"), (), 3)
    assert going_on_without(["c"], fits, already=["a"]) == (["c"], [])
    assert going_on_without(["b", "c"], fits, already=["a"]) == (["b"], ["c"])


def test_the_quick_check_waits_less_than_the_full_one():
    # a healthy sshd answers within milliseconds; the bound allows a resent SYN (1 s) and a busy host
    assert 1.0 < hostcheck.QUICK_TIMEOUT_S < hostcheck.TIMEOUT_S


# ---- agents that run on in the background ------------------------------------------------------

@pytest.fixture
def fake_agent(monkeypatch):
    """Each host's "agent" is a local Python that sleeps, then answers: host "a-R" sleeps R
    seconds, "a-R-K" R seconds as a reap and K as a kill. The job's ``started`` lists (host, mode)."""
    job = SimpleNamespace(dir="/nonexistent/job", started=[])

    def argv(job_, host, mode, seconds, extra=(), connect_timeout=None):
        parts = host.split("-")
        delay = float(parts[2] if mode == "kill" and len(parts) > 2 else parts[1])
        job.started.append((host, mode))
        code = (f"import json, time; time.sleep({delay}); "
                f"print(json.dumps({{'host': {host!r}, 'mode': {mode!r}}}), flush=True)")
        return [sys.executable, "-c", code]

    monkeypatch.setattr(kill, "agent_argv", argv)
    yield job
    kill.wait_agents()


def test_a_round_is_waited_for_host_by_host(fake_agent):
    r = kill.AgentRound(fake_agent, "kill", ["fast-0", "slow-30"], budget=1.0)
    assert r.wait(["fast-0"]) == {"fast-0": {"host": "fast-0", "mode": "kill"}}
    assert r._threads["slow-30"].is_alive()  # still running: the caller did not wait for it
    assert r.wait() == {"fast-0": {"host": "fast-0", "mode": "kill"}, "slow-30": None}  # killed at the budget
    assert r not in kill._rounds


def test_wait_agents_waits_for_every_round_in_flight(fake_agent):
    said = []
    kill.AgentRound(fake_agent, "reap", ["h-0.3"], budget=5.0, on_answer=lambda h, a: said.append((h, a)))
    kill.wait_agents()
    assert said == [("h-0.3", {"host": "h-0.3", "mode": "reap"})]
    assert not kill._rounds


def test_a_kill_takes_the_reap_answer_and_runs_its_own_agent_only_where_the_reap_gave_none(fake_agent):
    kill.AgentRound(fake_agent, "reap", ["a-0", "b-30-0"], budget=1.0, extra=("ns@0",))
    r = kill.start_kill(fake_agent, ["a-0", "b-30-0", "c-0"], "ns@0", budget=5.0)
    assert r.wait() == {"a-0": {"host": "a-0", "mode": "reap"}, "b-30-0": {"host": "b-30-0", "mode": "kill"},
                        "c-0": {"host": "c-0", "mode": "kill"}}
    assert sorted(fake_agent.started) == [("a-0", "reap"), ("b-30-0", "kill"), ("b-30-0", "reap"), ("c-0", "kill")]


def test_a_kill_of_another_job_does_not_take_the_reap_answer(fake_agent):
    kill.AgentRound(fake_agent, "reap", ["a-0"], budget=5.0, extra=("ns@0",))
    other = SimpleNamespace(dir="/nonexistent/other", started=[])
    assert kill.start_kill(other, ["a-0"], "ns@0", budget=5.0).wait() == {"a-0": {"host": "a-0", "mode": "kill"}}


def test_the_reap_runs_on_after_the_job_end_until_dtrun_waits_for_it(fake_agent):
    kill.reap_remote_daemons(fake_agent, ["h-30"], "ns@0", budget=1.0)
    reap = kill._reap_of(fake_agent, "ns@0")
    assert reap is not None and reap._threads["h-30"].is_alive()
    kill.wait_agents()
    assert reap.wait() == {"h-30": None} and not kill._rounds


def test_the_kill_rounds_answers_within_a_bound_leave_the_slow_hosts_out(fake_agent):
    r = kill.AgentRound(fake_agent, "kill", ["fast-0", "slow-30"], budget=2.0)
    assert r.answered_within(["fast-0", "slow-30", "not-in-round"], 1.0) == \
        {"fast-0": {"host": "fast-0", "mode": "kill"}}
    assert r._threads["slow-30"].is_alive()  # not waited for: it runs on to its own deadline


def test_a_failed_job_whose_run_cleans_up_gets_no_reap_from_the_hang_watch(monkeypatch, tmp_path):
    """Under --max-restarts the run's kill round stops what a failed attempt left on every host
    (and tidies): a reap from the hang watch beside it would only load the hosts twice."""
    import dtrun.launcher.hangwatch as hw
    from dtrun.launcher.jobstate import JobInfo

    rounds = []
    monkeypatch.setattr(hw, "reap_remote_daemons", lambda job, hosts, nspace: rounds.append(("reap", hosts)))
    monkeypatch.setattr(hw, "tidy_remote_hosts", lambda job, hosts: rounds.append(("tidy", hosts)))
    job = JobInfo(id="t", dir=str(tmp_path), hosts=("far1", "far2"), np=2, dtrun_pid=0)
    failed, ok = JobResult(returncode=1, mpirun_returncode=1), JobResult(returncode=0, mpirun_returncode=0)
    for reap in (True, False):
        hw.HangWatch(job, reap_daemons=reap, cleanup_follows=True).on_end(failed)
    assert rounds == []
    hw.HangWatch(job, reap_daemons=True, cleanup_follows=True).on_end(ok)  # PMIx's stuck daemon after a success
    hw.HangWatch(job, reap_daemons=True).on_end(failed)
    hw.HangWatch(job).on_end(failed)
    assert rounds == [("reap", ["far1", "far2"]), ("reap", ["far1", "far2"]), ("tidy", ["far1", "far2"])]


# ---- the run's ssh connections (launcher/sshmux.py) ---------------------------------------------
# A stand-in for ssh on PATH: the real one needs hosts (tests/test_restarts_cluster.py, section 7).
# It records its arguments, then acts as a master's remote command does: it reads its input
# to the end, or (host "gone") says what ssh says when the far end closes and exits 255.

FAKE_SSH = """#!/bin/sh
echo "$@" >> "$FAKE_SSH_LOG"
case "$*" in *" gone "*) echo "Connection to 10.9.9.9 closed by remote host." >&2; exit 255;; esac
exec cat >/dev/null
"""


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    (tmp_path / "ssh.log").touch()  # read before the first stand-in writes to it
    cache = tempfile.mkdtemp(prefix="dtm", dir="/tmp")  # short: a socket's path has 108 bytes
    monkeypatch.setenv("XDG_CACHE_HOME", cache)
    yield tmp_path / "ssh.log"
    shutil.rmtree(cache, ignore_errors=True)


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_masters_run_until_the_run_closes_them_and_leave_nothing(fake_ssh):
    m = sshmux.Masters()
    m.start(["h1", "h2", "h1"], "/c/cfg")
    assert _until(lambda: len(fake_ssh.read_text().splitlines()) == 2)
    folder = Path(m.pattern).parent
    assert m.pattern.endswith("/%C") and stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for line in fake_ssh.read_text().splitlines():
        assert line.startswith(f"-o ControlMaster=yes -o ControlPath={m.pattern} -o ControlPersist=no -o BatchMode=yes")
        assert "-F /c/cfg" in line and line.endswith("exec cat >/dev/null")
    assert m.control_args("h1") == ["-o", "ControlMaster=no", "-o", f"ControlPath={m.pattern}"]
    assert m.control_args("h3") == [] and m.shared_path() == m.pattern
    m.start(["h1"], None)  # one runs already: no second
    assert len(fake_ssh.read_text().splitlines()) == 2
    procs = list(m._procs.values())
    m.close()
    assert all(p.returncode == 0 for p in procs)  # ended by their input's end, not killed
    assert not folder.exists() and m.shared_path() is None and m.control_args("h1") == []
    m.start(["h4"], None)  # a closed run opens no more
    assert len(fake_ssh.read_text().splitlines()) == 2


def test_masters_open_once_every_rank_has_started_and_the_job_writes(fake_ssh):
    """Opened beside mpirun's ssh or the ranks' start they would slow the launch: they wait for the job to run."""
    m = sshmux.Masters()
    watch = sshmux.OpenOnceStarted(m, ["h1", "h2"], None, np=3)

    def openers():
        return [t for t in threading.enumerate() if t.name == "dtrun-ssh-masters"]

    try:
        watch.on_rank_start("0", "h1")
        watch.on_output("stdout", b"before every rank started\n")
        watch.on_rank_start("1", "h2")
        watch.on_rank_start("1", "h2")  # the same rank twice counts once
        watch.on_rank_start("2", "h2")
        # the opener runs on a thread that on_output itself starts: none was started yet
        assert not openers() and not m._procs
        watch.on_output("stderr", b"step 1\n")
        assert _until(lambda: len(fake_ssh.read_text().splitlines()) == 2)
        assert _until(lambda: not openers())
        watch.on_output("stdout", b"step 2\n")
        assert not openers() and len(m._procs) == 2  # opened once
    finally:
        m.close()


def test_a_master_whose_host_closed_the_connection_names_it_and_is_passed_over(fake_ssh):
    m = sshmux.Masters()
    m.start(["h1", "gone"], None)
    try:
        assert _until(lambda: m.closed_hosts() == ["gone"])
        assert _until(lambda: m.control_args("gone") == [])  # once it has exited, the agent's ssh connects by itself
        assert m.control_args("h1") != []
    finally:
        m.close()


def test_a_cache_path_too_long_for_a_socket_puts_the_sockets_in_tmp(fake_ssh, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ("long" * 12)))
    m = sshmux.Masters()
    m.start(["h1"], None)
    try:
        assert m.pattern.startswith(f"/tmp/dtrun-{os.geteuid()}/ssh/mux-") and len(m.pattern) <= 100
    finally:
        m.close()


def test_agents_go_through_the_active_masters_only(fake_ssh):
    from dtrun.launcher.job.agents import agent_argv
    from dtrun.launcher.jobstate import JobInfo

    job = JobInfo(id="t", dir="/j", hosts=("h1",), np=1, dtrun_pid=0)
    assert "ControlMaster=no" not in agent_argv(job, "h1", "kill", 5)
    m = sshmux.Masters()
    m.start(["h1"], None)
    sshmux.activate(m)
    try:
        argv = agent_argv(job, "h1", "kill", 5)
        assert argv[:7] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "ControlMaster=no"]
        assert agent_argv(job, "localhost", "kill", 5)[0] != "ssh"
    finally:
        sshmux.activate(None)
        m.close()
    assert "ControlMaster=no" not in agent_argv(job, "h1", "kill", 5)


# ---- the observers' ends ------------------------------------------------------------------------

class Meets:
    """An observer whose end returns only once every other one's end has begun."""

    def __init__(self, barrier):
        self.barrier = barrier

    def on_end(self, result):
        self.barrier.wait()


def test_observers_end_at_once_and_an_error_reaches_the_caller():
    barrier = threading.Barrier(3, timeout=10)
    end_observers([Meets(barrier), Meets(barrier), Meets(barrier)], ended())  # in turn, the first would wait forever
    assert not barrier.broken

    class Broken:
        def on_end(self, result):
            raise RuntimeError("observer failed")

    with pytest.raises(RuntimeError, match="observer failed"):
        end_observers([Meets(threading.Barrier(1)), Broken()], ended())
