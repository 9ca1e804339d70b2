"""Elastic runs: ``hvd.elastic`` commits kept on each host, a lost host costing a commit, not a
checkpoint, and ``--host-discovery-script`` growing the job (launcher/elastic.py,
collectives/horovod/_elastic.py, dtrun/commitstore.py).

The pure rules are tested by value; the rest with real dtrun, real mpirun and, for hosts,
network-namespace hosts with real faults (tests/test_restarts_cluster.py's ``lose``).
"""
import os
import pickle
import re
import subprocess
import sys

import pytest

from dtrun import commitstore
from dtrun.launcher import elastic
from dtrun.launcher.errors import UsageError
from dtrun.launcher.hostfile import HostSlots
from tests.dtrun_helpers import OTHER_UID, PYTHON, REPO, dtrun, finish, module_cluster, one_line_error, user_env

EXAMPLE = str(REPO / "examples" / "elastic_torch.py")
MPI4 = "/usr/bin/mpirun.openmpi"
MPI4_LIB = f"/usr/lib/{os.uname().machine}-linux-gnu/libmpi.so.40"
MPICH = "/usr/bin/mpiexec.mpich"
MPICH_LIB = f"/usr/lib/{os.uname().machine}-linux-gnu/libmpich.so.12"


# ---- the pure rules ---------------------------------------------------------------------------

def test_discovery_output_is_horovodruns_format():
    text = "# hosts\nh1:4\nh2\n\n  h3:2  # a comment\nh1:2\n[fe80::1]:3\n"
    assert elastic.parse_discovered(text, "s.sh") == [HostSlots("h2", 1), HostSlots("h3", 2), HostSlots("h1", 2),
                                                      HostSlots("fe80::1", 3)]
    for bad, where in (("h1:x\n", "s.sh:1"), ("ok:1\nh;rm -rf /:1\n", "s.sh:2"), ("h1:0\n", "s.sh:1")):
        with pytest.raises(UsageError) as e:
            elastic.parse_discovered(bad, "s.sh")
        assert where in str(e.value), str(e.value)


def test_host_change_names_what_the_job_can_use():
    listed = [HostSlots("a", 1), HostSlots("b", 1), HostSlots("c", 1)]
    assert elastic.host_change(["a", "b"], 2, listed, [], None) == elastic.Change(("c",), ())
    assert not elastic.host_change(["a", "b"], 2, listed, ["c"], None)  # kept out (lost too often)
    assert not elastic.host_change(["a", "b"], 2, listed, [], 2)  # --max-np reached
    assert elastic.host_change(["a", "b", "c"], 3, listed[:2], [], None) == elastic.Change((), ("c",))
    change = elastic.host_change(["a", "d"], 2, listed, [], None)
    assert change.added == ("b", "c") and change.removed == ("d",) and change.kind() == "added"
    assert change.words() == "b, c listed; d no longer listed"
    assert elastic.Change((), ("d",)).kind() == "removed"


def test_a_host_may_come_back_once():
    rule = elastic.FlapRule()
    rule.record("c")
    assert not rule.barred("c")
    rule.record("c")
    assert rule.barred("c") and rule.why("c") == "lost 2 times in this run; not taken back"
    assert not rule.barred("a")


def test_target_np_takes_every_slot_up_to_max_np():
    assert elastic.target_np(5, None, 2) == 5
    assert elastic.target_np(5, 3, 2) == 3
    with pytest.raises(ValueError, match="1 usable slot, fewer than 2"):
        elastic.target_np(1, 3, 2)


def test_only_the_reset_code_without_a_signal_is_a_reset():
    from dtrun.collectives.horovod import _elastic
    from dtrun.launcher.job.result import RankFailure

    assert elastic.RESET_EXIT_CODE == _elastic.RESET_EXIT_CODE
    assert elastic.NOTICE == _elastic.NOTICE
    fields = RankFailure.__dataclass_fields__

    def failure(code, signum):
        kw = {k: None for k in fields}
        kw.update(rank="0", host="h1", code=code, signum=signum)
        return RankFailure(**kw)
    assert elastic.is_reset(failure(75, None))
    assert not elastic.is_reset(failure(1, None))
    assert not elastic.is_reset(failure(None, 9))
    assert not elastic.is_reset(None)


# ---- bad input: one line, exit 2, before anything runs ----------------------------------------

def _script(tmp_path, text="#!/bin/sh\necho localhost:2\n", mode=0o755, name="discover.sh"):
    p = tmp_path / name
    p.write_text(text)
    p.chmod(mode)
    return p


def test_discovery_flags_are_checked_first(tmp_path):
    ok = _script(tmp_path)
    run = ("--dry-run", "python", "x.py")
    one_line_error(dtrun("--host-discovery-script", tmp_path / "none.sh", *run), "--host-discovery-script",
                   "no such file")
    one_line_error(dtrun("--host-discovery-script", _script(tmp_path, mode=0o644, name="x.sh"), *run),
                   "not executable")
    one_line_error(dtrun("--host-discovery-script", ok, "-H", "localhost:2", *run), "leave out -H")
    one_line_error(dtrun("--max-np", "4", *run), "--max-np", "add --host-discovery-script")
    one_line_error(dtrun("--host-discovery-script", ok, "--max-np", "0", *run), "--max-np must be a positive integer, got 0")
    one_line_error(dtrun("--host-discovery-script", ok, "-np", "3", "--max-np", "2", *run), "-np 3 is more than --max-np 2")
    one_line_error(dtrun("--host-discovery-script", _script(tmp_path, "#!/bin/sh\necho 'h1:1;reboot'\n", name="b.sh"),
                         *run), "b.sh:1")
    one_line_error(dtrun("--host-discovery-script", _script(tmp_path, "#!/bin/sh\necho no >&2\nexit 3\n",
                                                            name="c.sh"), *run), "exited with code 3: no")
    one_line_error(dtrun("--host-discovery-script", _script(tmp_path, "#!/bin/sh\n", name="d.sh"), *run),
                   "listed no host")


def test_dry_run_uses_the_hosts_the_script_lists(tmp_path):
    p = dtrun("--host-discovery-script", _script(tmp_path), "--dry-run", "python", "x.py")
    assert p.returncode == 0, p.stderr
    # it restarts the job (--max-restarts 3 unless given), so the restart options go with it
    p = dtrun("--host-discovery-script", _script(tmp_path), "--min-np", "1", "--dry-run", "python", "x.py")
    assert p.returncode == 0, p.stderr
    assert re.search(r"-np 2\b", p.stdout), p.stdout
    assert "DTRUN_RUN_ID" not in p.stdout  # a dry run is one attempt: no run id, no commits


# ---- the commit store and the notice: only this user's own files --------------------------------

def test_commit_store_round_trip_and_removal(tmp_path):
    s = commitstore.Store("run-1", str(tmp_path / "c"), host="h1")
    assert s.read() is None
    s.write(3, 2, b"abc")
    s.write(4, 2, b"abcd")
    got = s.read()
    assert (got.seq, got.size, got.payload) == (4, 2, b"abcd")
    assert oct((tmp_path / "c" / "commits" / "run-1" / "h1").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "c" / "commits" / "run-1" / "h1" / "commit").stat().st_mode & 0o777) == "0o600"
    s.remove()
    assert not (tmp_path / "c" / "commits" / "run-1").exists()
    with pytest.raises(ValueError):
        commitstore.Store("../x", str(tmp_path))


def _planted_pickle(marker):
    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    return pickle.dumps({"objects": Boom()})


@pytest.mark.parametrize("how", ["symlinked run dir", "run dir of another user", "open run dir",
                                 "file of another user", "symlinked file", "bad checksum"])
def test_a_planted_commit_is_refused_and_never_unpickled(tmp_path, how):
    if how.endswith("another user") and os.geteuid() != 0:
        pytest.skip("needs root to make another user's files")
    root = tmp_path / "c"
    marker = tmp_path / "pwned"
    good = commitstore.Store("run-1", str(root), host="h1")
    good.write(1, 1, b"x")  # the directories exist and are right
    run_dir, host_dir = root / "commits" / "run-1", root / "commits" / "run-1" / "h1"
    evil = tmp_path / "evil"
    evil.mkdir()
    payload = _planted_pickle(marker)
    victim = commitstore.Store("run-1", str(root), host="h1")
    if how == "symlinked run dir":
        (evil / "h1").mkdir(mode=0o700)
        commitstore.Store("x", str(tmp_path / "e2"), host="h1").write(9, 1, payload)
        os.rename(tmp_path / "e2" / "commits" / "x" / "h1" / "commit", evil / "h1" / "commit")
        for p in sorted(run_dir.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        run_dir.rmdir()
        run_dir.symlink_to(evil)
    elif how == "run dir of another user":
        os.chown(run_dir, OTHER_UID, OTHER_UID)
    elif how == "open run dir":
        run_dir.chmod(0o777)
    else:
        commitstore.Store("y", str(tmp_path / "e3"), host="h1").write(9, 1, payload)
        planted = tmp_path / "e3" / "commits" / "y" / "h1" / "commit"
        if how == "file of another user":
            os.chown(planted, OTHER_UID, OTHER_UID)
            os.replace(planted, host_dir / "commit")
        elif how == "symlinked file":
            os.unlink(host_dir / "commit")
            (host_dir / "commit").symlink_to(planted)
        else:
            data = planted.read_bytes()
            (host_dir / "commit").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(commitstore.CommitStoreError) as e:
        victim.read()
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_notice_is_read_only_from_dtruns_own_file(tmp_path):
    from dtrun.collectives.horovod._elastic import ADDED, REMOVED, read_notice

    assert read_notice(str(tmp_path)) == (0, 0)
    elastic.write_notice(str(tmp_path), "123 added\n")
    assert read_notice(str(tmp_path)) == (123, ADDED)
    elastic.write_notice(str(tmp_path), "124 removed\n")
    assert read_notice(str(tmp_path)) == (124, REMOVED)
    (tmp_path / elastic.NOTICE).write_text("125 added; rm -rf\n")
    assert read_notice(str(tmp_path)) == (0, 0)
    if os.geteuid() == 0:
        elastic.write_notice(str(tmp_path), "126 added\n")
        os.chown(tmp_path / elastic.NOTICE, OTHER_UID, OTHER_UID)
        assert read_notice(str(tmp_path)) == (0, 0)


def test_the_host_agent_posts_the_notice(tmp_path):
    agent = REPO / "launcher" / "remote" / "agent.py"
    job = tmp_path / "job"
    p = subprocess.run([sys.executable, "-S", str(agent), "notice", str(job), "5", "777", "added"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and '"posted": true' in p.stdout, p
    assert (job / elastic.NOTICE).read_text() == "777 added\n"
    for bad in (["77x", "added"], ["1", "added\n2 removed"], ["1", "grown"]):
        p = subprocess.run([sys.executable, "-S", str(agent), "notice", str(job), "5", *bad],
                           capture_output=True, text=True, timeout=30)
        assert '"posted": false' in p.stdout, p
    assert (job / elastic.NOTICE).read_text() == "777 added\n"


def test_the_host_agent_forgets_a_runs_commits(tmp_path):
    import socket

    agent = REPO / "launcher" / "remote" / "agent.py"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    store = commitstore.Store("run-9", str(tmp_path / "cache" / "dtrun"), host=socket.gethostname())
    store.write(1, 2, b"x")
    for run, forgot in (("../x", "false"), ("run-9", "true")):
        p = subprocess.run([sys.executable, "-S", str(agent), "forget", str(tmp_path / "job"), "5", run], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=30)
        assert p.returncode == 0 and f'"forgot": {forgot}' in p.stdout, p
    assert os.listdir(tmp_path / "cache" / "dtrun" / "commits") == []


# ---- localhost: a killed rank costs the steps since the last commit ------------------------------

def _final(out):
    """{rank: weights} of the ranks' ``final w`` lines, and the ranks' count."""
    rows = re.findall(r"rank (\d+) of (\d+) on (\S+) final w (.+)$", out, re.M)
    return {int(r): w for r, _, _, w in rows}, {int(n) for _, n, _, _ in rows}


_REFERENCES: dict = {}


def _reference(np_, tmp_path, steps=60):
    """The final weights of a run of ``np_`` ranks that never failed, on this host (a run per
    (ranks, steps) in the session: every MPI flavor's run must end with the same)."""
    if (np_, steps) not in _REFERENCES:
        p = dtrun("--horovod", "-np", np_, "--oversubscribe", "--no-tag-output", PYTHON, EXAMPLE, "--steps", steps,
                  timeout=180, env=user_env(XDG_CACHE_HOME=str(tmp_path / "ref-cache")))
        assert p.returncode == 0, p.stderr
        weights, _ = _final(p.stdout)
        assert len(set(weights.values())) == 1, p.stdout
        _REFERENCES[np_, steps] = weights[0]
    return _REFERENCES[np_, steps]


@pytest.mark.mpi
def test_a_killed_rank_resumes_from_the_last_commit_with_the_same_result(tmp_path):
    want = _reference(2, tmp_path)
    cache = tmp_path / "cache"
    p = dtrun("--horovod", "-np", 2, "--max-restarts", 1, "--no-tag-output", PYTHON, EXAMPLE, "--steps", "60",
              "--commit-every", "4", "--crash-at", "30", timeout=240, env=user_env(XDG_CACHE_HOME=str(cache)))
    assert p.returncode == 0, p.stderr
    m = re.search(r"^dtrun elastic: resumed from commit (\d+) \(made by 2 ranks\), held on \S+; 2 ranks now$",
                  p.stderr, re.M)
    assert m and int(m.group(1)) == 7, p.stderr  # step 28: the last commit before the crash at 30
    assert "start at step 28: 2 ranks" in p.stdout, p.stdout
    weights, sizes = _final(p.stdout)
    assert sizes == {2} and set(weights.values()) == {want}, p.stdout
    assert os.listdir(cache / "dtrun" / "commits") == []  # the run ended well: its commits are gone


@pytest.mark.mpi
def test_a_run_that_fails_for_good_leaves_no_commit_behind(tmp_path):
    cache = tmp_path / "cache"
    script = tmp_path / "fails.py"
    script.write_text("import sys\nimport horovod.torch as hvd\nhvd.init()\n"
                      "@hvd.elastic.run\ndef train(state):\n    state.commit()\n    hvd.barrier()\n"
                      "    if hvd.rank() == 1:\n        sys.exit(3)\n    hvd.barrier()\n"
                      "train(hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0))\n")
    p = dtrun("--horovod", "-np", 2, "--max-restarts", 3, PYTHON, script, timeout=240,
              env=user_env(XDG_CACHE_HOME=str(cache)))
    assert p.returncode == 3, p.stderr
    assert "not restarting: the same failure twice in a row" in p.stderr, p.stderr
    assert "resumed from commit 1" in p.stderr, p.stderr  # the second attempt found the first's commit
    assert os.listdir(cache / "dtrun" / "commits") == []


@pytest.mark.mpi
def test_without_restarts_commits_stay_in_memory(tmp_path):
    cache = tmp_path / "cache"
    p = dtrun("--horovod", "-np", 2, "--no-tag-output", PYTHON, EXAMPLE, "--steps", "8", timeout=180,
              env=user_env(XDG_CACHE_HOME=str(cache)))
    assert p.returncode == 0, p.stderr
    assert "dtrun elastic" not in p.stderr
    assert not (cache / "dtrun" / "commits").exists()


# ---- namespace hosts: a lost host, a host added, a host that flaps ------------------------------

@pytest.fixture(scope="module")
def cluster4():
    yield from module_cluster(4, terminate_strays=True)


def _flavor(name, cluster, tmp_path):
    """dtrun's options for one MPI (a skip where it is not installed)."""
    if name == "openmpi5":
        return []
    if name == "openmpi4":
        if not (os.path.exists(MPI4) and os.path.exists(MPI4_LIB)):
            pytest.skip("Open MPI 4 not installed (CI installs openmpi-bin)")
        return ["--mpirun", MPI4, "-x", f"MPI4PY_LIBMPI={MPI4_LIB}"]
    if not (os.path.exists(MPICH) and os.path.exists(MPICH_LIB)):
        pytest.skip("MPICH not installed (CI installs mpich)")
    # mpi4py's MPICH build loads libmpi.so.12; Debian names MPICH's library libmpich.so.12
    libs = tmp_path / "mpich-lib"
    libs.mkdir(exist_ok=True)
    (libs / "libmpi.so.12").symlink_to(MPICH_LIB)
    # Hydra's proxies call back to this host by its name, which maps to loopback here: name the bridge.
    return ["--mpirun", MPICH, "-x", f"MPI4PY_LIBMPI={libs / 'libmpi.so.12'}", "-x", f"LD_LIBRARY_PATH={libs}",
            "--mpi-args", f"-iface {cluster.bridge}"]


@pytest.mark.cluster
@pytest.mark.mpi
@pytest.mark.parametrize("flavor", ["openmpi5", "openmpi4", "mpich"])
def test_a_lost_host_costs_the_steps_since_the_last_commit(cluster4, tmp_path, flavor):
    """No checkpoint file, no shared directory: each host keeps its own commits (XDG_CACHE_HOME
    is given to every rank so the test can look), and the next attempt takes a survivor's."""
    from tests.test_restarts_cluster import lose_at, start

    extra = _flavor(flavor, cluster4, tmp_path)
    want = _reference(3, tmp_path)
    a, b, c, d = cluster4.hosts
    cache = tmp_path / "cache"
    p = start(cluster4, *extra, "--horovod", "-H", ",".join(f"{h.name}:1" for h in cluster4.hosts), "-np", "3",
              "--max-restarts", "2", "-x", f"XDG_CACHE_HOME={cache}", PYTHON, EXAMPLE, "--steps", "60",
              "--step-time", "0.15", "--commit-every", "2")
    rc, out, err = lose_at(cluster4, p, r"^step 12 ", b)
    assert rc == 0, err
    assert re.search(rf"^dtrun: attempt 2 of 3: {b.name} left out \(.+\); .+; 3 ranks on {a.name}, {c.name}, "
                     rf"{d.name} \(spare\)$", err, re.M), err
    m = re.search(r"^dtrun elastic: resumed from commit (\d+) \(made by 3 ranks\), held on (\S+); 3 ranks now$",
                  err, re.M)
    assert m and int(m.group(1)) >= 6 and m.group(2) in (a.name, c.name), err
    assert f"start at step {2 * int(m.group(1))}: 3 ranks" in out, out
    weights, sizes = _final(out)
    assert sizes == {3} and set(weights.values()) == {want}, out
    # what is left: the lost host's own commits, nothing of the others (they removed theirs)
    assert [p.name for p in (cache / "dtrun" / "commits").iterdir() for p in p.iterdir()] == [b.name]


def _discovery(tmp_path, hosts):
    listing = tmp_path / "hosts.txt"
    listing.write_text("".join(f"{h.name}:1\n" for h in hosts))
    return _script(tmp_path, f"#!/bin/sh\ncat {listing}\n"), listing


@pytest.mark.cluster
@pytest.mark.mpi
def test_a_host_the_script_adds_joins_at_the_next_commit(cluster4, tmp_path):
    from tests.test_restarts_cluster import read_until, start

    a, b, c, _ = cluster4.hosts
    script, listing = _discovery(tmp_path, [a, b])
    p = start(cluster4, "--horovod", "--host-discovery-script", script, "--max-np", "3",
              PYTHON, EXAMPLE, "--steps", "80", "--step-time", "0.15")
    seen = []
    try:
        seen = read_until(p.stdout, r"^step 6 ")
        listing.write_text(f"{a.name}:1\n{b.name}:1\n{c.name}:1\n")
    finally:
        rc, out, err = finish(p, 180)
    out = "".join(seen) + out
    assert rc == 0, err
    assert f"dtrun: hosts changed: {c.name} listed; the job moves at its next commit" in err, err
    assert re.search(rf"^dtrun: the hosts changed \({c.name} listed\); the job resumes from its last "
                     rf"commit; 3 ranks on {a.name}, {b.name}, {c.name}$", err, re.M), err
    assert "job failed" not in err  # leaving at a commit is no failure
    m = re.search(r"^dtrun elastic: resumed from commit (\d+) \(made by 2 ranks\), held on \S+; 3 ranks now$",
                  err, re.M)
    assert m, err
    assert "start at step 0: 2 ranks" in out and f"start at step {2 * int(m.group(1))}: 3 ranks" in out, out
    weights, sizes = _final(out)
    assert sizes == {3} and len(weights) == 3 and len(set(weights.values())) == 1, out  # the ranks agree
    want = [float(v) for v in _reference(3, tmp_path, steps=80).split()]
    assert all(abs(float(x) - y) < 1e-9 for x, y in zip(weights[0].split(), want)), (weights[0], want)


@pytest.mark.cluster
@pytest.mark.mpi
def test_a_flapping_host_is_taken_back_once(cluster4, tmp_path):
    """Lost, back (it joins at a commit), lost again: then it stays out, and the job ends on the others."""
    from tests.test_restarts_cluster import lose, read_until, revive, start

    a, b, c, _ = cluster4.hosts
    script, _ = _discovery(tmp_path, [a, b, c])
    p = start(cluster4, "--horovod", "--host-discovery-script", script, "--min-np", "2", "--max-restarts", "3",
              PYTHON, EXAMPLE, "--steps", "250", "--step-time", "0.1")
    down = False
    try:
        for round_ in range(2):
            read_until(p.stdout, r"^step \d+ ranks 3")
            lose(c)
            down = True
            read_until(p.stdout, r"^start at step \d+: 2 ranks", timeout=120)
            revive(cluster4, c)
            down = False
            if round_ == 0:
                read_until(p.stdout, r"^start at step \d+: 3 ranks", timeout=120)
    finally:
        if down:
            revive(cluster4, c)
        rc, out, err = finish(p, 240)
    assert rc == 0, err
    assert re.search(rf"^dtrun: attempt 2 of 4: {c.name} left out \(.+\); .+; 2 ranks on {a.name}, {b.name}$",
                     err, re.M), err
    assert re.search(rf"^dtrun: the hosts changed \({c.name} listed\); .+; 3 ranks on {a.name}, "
                     rf"{b.name}, {c.name}$", err, re.M), err
    third = re.search(rf"^dtrun: attempt 3 of 4: {c.name} left out \(.+\); (.+); 2 ranks on {a.name}, {b.name}$",
                      err, re.M)
    assert third, err
    # That attempt's daemons ran through the run's ssh connections (launcher/sshmux.py): Open MPI
    # then says a daemon "failed to report back" and exits 255, which is still a lost daemon.
    assert "mpirun exited with code 255" not in third.group(1), err
    assert f"dtrun: host {c.name} is listed again but was lost 2 times in this run; not taken back" in err, err
    assert "attempt 5" not in err
    weights, sizes = _final(out)
    assert sizes == {2} and len(set(weights.values())) == 1, out
