"""The pure parts of restarts (launcher/restarts.py): host plans with spares and --min-np,
blame, the no-blind-loop rule, the attempt line; the options as users type them; and the
checkpoint helpers of collectives.dp on one rank and on several."""
import signal

import pytest

from dtrun.launcher.errors import ExitCode
from dtrun.launcher.hostfile import HostSlots
from dtrun.launcher.restarts import (
    Failure,
    HostPlan,
    NotEnoughSlots,
    attempt_line,
    failure_of,
    last_exception,
    lost_host_lines,
    plan_hosts,
    repeated_failure,
)
from dtrun.launcher.job.result import JobResult, RankFailure, StopReason, StopState
from tests.dtrun_helpers import PYTHON, REPO, dtrun, one_line_error


def hosts(spec):
    return [HostSlots(name, int(n)) for name, n in (item.split(":") for item in spec.split(","))]


def names(plan):
    return [h.host for h in plan.hosts]


# ---- where an attempt runs ------------------------------------------------------------------

def test_first_attempt_keeps_hosts_beyond_np_spare():
    plan = plan_hosts(hosts("a:4,b:4,c:4,d:4"), (), (), 12)
    assert (names(plan), plan.np, plan.spares) == (["a", "b", "c"], 12, ())
    assert plan.rank_hosts == ("a",) * 4 + ("b",) * 4 + ("c",) * 4


def test_lost_host_is_replaced_by_the_spare_beyond_np():
    plan = plan_hosts(hosts("a:4,b:4,c:4,d:4"), (), ["b"], 12, first=["a", "b", "c"])
    assert (names(plan), plan.np, plan.spares) == (["a", "c", "d"], 12, ("d",))


def test_spares_option_hosts_come_after_the_job_hosts():
    plan = plan_hosts(hosts("a:1,b:1,c:1"), hosts("s1:1,s2:1"), ["a"], 3, first=["a", "b", "c"])
    assert (names(plan), plan.spares) == (["b", "c", "s1"], ("s1",))


def test_min_np_goes_on_with_the_slots_left():
    plan = plan_hosts(hosts("a:2,b:2,c:2"), (), ["c"], 6, min_np=3, first=["a", "b", "c"])
    assert (names(plan), plan.np) == (["a", "b"], 4)


def test_too_few_slots_is_refused_naming_them():
    with pytest.raises(NotEnoughSlots, match=r"^4 slots left on a, b \(left out: c\), fewer than -np 6 or --min-np 5$"):
        plan_hosts(hosts("a:2,b:2,c:2"), (), ["c"], 6, min_np=5)
    with pytest.raises(NotEnoughSlots, match=r"fewer than -np 3$"):
        plan_hosts(hosts("a:1,b:1,c:1"), (), ["b"], 3)
    with pytest.raises(NotEnoughSlots, match=r"^no host is left \(left out: a\)$"):
        plan_hosts(hosts("a:1"), (), ["a"], 1, min_np=1)


# ---- blame and the no-blind-loop rule ---------------------------------------------------------

def result(*failures, **kw):
    return JobResult(returncode=kw.pop("returncode", 1), mpirun_returncode=kw.pop("mpirun", 1), failures=list(failures), **kw)


def test_failure_names_the_root_cause_and_its_exception():
    r = result(RankFailure("1", "h2", signum=signal.SIGTERM, forwarded=True), RankFailure("0", "h1", code=1))
    f = failure_of(r, ("/x/train.py:12", "KeyError"))
    assert f.what == "rank 0 on h1 exited with code 1 (KeyError at /x/train.py:12)"
    assert f.hosts == ("h1",) and f.restartable


def same_failure_twice(previous, current, hosts_healthy):
    """The rule for two attempts in a row (``previous`` None: the one before ended on a bad host)."""
    earlier = {} if previous is None else {previous.key: 0}
    return repeated_failure(earlier, current, hosts_healthy) is not None


def test_same_exception_on_another_rank_is_the_same_failure():
    a = failure_of(result(RankFailure("0", "h1", code=1)), ("/x/train.py:12", "KeyError"))
    b = failure_of(result(RankFailure("2", "h3", code=1)), ("/x/train.py:12", "KeyError"))
    c = failure_of(result(RankFailure("0", "h1", code=1)), ("/x/train.py:13", "KeyError"))
    assert same_failure_twice(a, b, hosts_healthy=True)
    assert not same_failure_twice(a, c, hosts_healthy=True)
    assert not same_failure_twice(a, b, hosts_healthy=False)  # a host failed the check: not the program's fault
    assert not same_failure_twice(None, b, hosts_healthy=True)


def test_a_lost_traceback_does_not_make_the_same_exit_a_new_failure():
    seen = failure_of(result(RankFailure("1", "h2", code=1)), ("/x/bug.py:5", "KeyError"))
    lost = failure_of(result(RankFailure("1", "h2", code=1)))  # its traceback never reached dtrun
    other = failure_of(result(RankFailure("1", "h2", code=2)))
    assert same_failure_twice(seen, lost, True) and same_failure_twice(lost, seen, True)
    assert not same_failure_twice(seen, other, True)
    assert not same_failure_twice(seen, lost, False)


def test_same_exit_code_is_the_same_failure_a_kill_only_on_the_same_rank():
    code = [failure_of(result(RankFailure(r, "h", code=3))) for r in ("0", "1")]
    kill = [failure_of(result(RankFailure(r, "h", signum=signal.SIGKILL, forwarded=False))) for r in ("0", "1", "1")]
    assert same_failure_twice(code[0], code[1], True)
    assert not same_failure_twice(kill[0], kill[1], True) and same_failure_twice(kill[1], kill[2], True)


HANG = StopState(StopReason.HANG, "no progress (--on-hang abort)")


def test_signals_timeouts_and_hang_abort_are_never_restarted():
    assert not failure_of(result(stops=[StopState(StopReason.SIGNAL, "stopped by SIGTERM", signal.SIGTERM)])).restartable
    assert not failure_of(result(stops=[StopState(StopReason.TIMEOUT, "the job ran longer than --timeout 5 s")]), timed_out=True).restartable
    assert not failure_of(result(stops=[HANG]), on_hang="abort").restartable
    assert failure_of(result(stops=[HANG]), on_hang="restart").restartable
    assert failure_of(result(lost_daemon_host="h2")).hosts == ("h2",)


def test_last_exception_reads_tagged_tracebacks():
    lines = ["[h1,0]<stderr>: Traceback (most recent call last):",
             '[h1,0]<stderr>:   File "/x/train.py", line 40, in <module>',
             '[h1,0]<stderr>:   File "/x/model.py", line 7, in step',
             "[h1,0]<stderr>: ValueError: nan loss", "other output"]
    assert last_exception(lines) == ("/x/model.py:7", "ValueError")
    assert last_exception(["no traceback here"]) is None


# ---- what users read ------------------------------------------------------------------------

def test_attempt_line_says_what_failed_who_is_left_out_and_where_it_runs():
    plan = HostPlan(tuple(hosts("hnode1:1,hnode3:1,hnode4:1")), 3, ("hnode4",))
    f = Failure("rank 1 on hnode2 killed by SIGKILL", ("x",))
    assert attempt_line(2, 3, f, {"hnode2": "ssh: TCP to hnode2 (10.0.0.2:22) timed out after 5 s"}, plan) == (
        "dtrun: attempt 2 of 3: hnode2 left out (ssh: TCP to hnode2 (10.0.0.2:22) timed out after 5 s); "
        "rank 1 on hnode2 killed by SIGKILL; 3 ranks on hnode1, hnode3, hnode4 (spare)")
    assert attempt_line(2, 2, f, {}, HostPlan(tuple(hosts("a:2")), 2)) == (
        "dtrun: attempt 2 of 2: rank 1 on hnode2 killed by SIGKILL; every host passed the check; 2 ranks on a")


def test_lost_host_line_names_its_ranks():
    assert lost_host_lines({"h2": "ssh: refused"}, ["h1", "h2", "h2", "h3"]) == [
        "dtrun: host h2 was lost: ssh: refused; ranks 1,2 were on it"]
    assert lost_host_lines({"h4": "ssh: refused"}, ["h1"]) == ["dtrun: host h4 was lost: ssh: refused; it held no rank"]


def test_exit_code_of_restarts_used_up():
    assert ExitCode.RESTARTS == 123


@pytest.mark.parametrize("args, needles", [
    (("--spares", "b:1"), ("--spares is used when a job restarts: add --max-restarts N",)),
    (("--min-np", "1"), ("--min-np is used when a job restarts",)),
    (("--max-restarts", "1", "--min-np", "5", "-np", "2"), ("--min-np 5 is more than -np 2",)),
    (("--max-restarts", "1", "--spares", "localhost:1"), ("--spares: localhost already in the job's hosts",)),
    (("--max-restarts", "-1"), ("--max-restarts -1: give 0 or more",)),
    (("--max-restarts", "1", "--min-np", "x"), ("--min-np",)),
])
def test_restart_options_misused_are_one_line_errors(args, needles):
    one_line_error(dtrun("-H", "localhost:2", *args, "true", timeout=60), *needles)


def test_on_hang_restart_is_accepted_and_restart_count_reaches_ranks():
    p = dtrun("-np", "1", "--max-restarts", "1", "--on-hang", "restart", "--hang-timeout", "30", PYTHON, "-c",
              "import os; print(os.environ['DTRUN_RESTART_COUNT'], os.environ['TORCHELASTIC_RESTART_COUNT'])",
              timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0", "0"]


# ---- checkpoints ----------------------------------------------------------------------------

def test_checkpoint_helpers_on_one_rank(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (collectives.dp needs it)")
    import dtrun.collectives.dp as dp

    dp.init()
    path = tmp_path / "ckpt.pt"
    assert dp.load_checkpoint(path) is None
    dp.save_checkpoint(path, {"step": 3, "w": torch.arange(4.0)})
    dp.save_checkpoint(path, {"step": 4, "w": torch.arange(4.0) * 2})  # replaces it whole
    got = dp.load_checkpoint(path)
    assert got["step"] == 4 and got["w"].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary file left
    with pytest.raises(OSError, match="save_checkpoint on rank 0: .*missing"):
        dp.save_checkpoint(tmp_path / "missing" / "ckpt.pt", {"step": 1})


@pytest.mark.mpi
@pytest.mark.parametrize("runtime", ["collectives", "mpi4py"])
def test_example_resumes_after_a_killed_rank_with_each_runtime(tmp_path, runtime):
    if runtime == "collectives":
        pytest.importorskip("torch", reason="PyTorch is not installed (collectives.dp needs it)")
    example = str(REPO / "examples" / "train_resume.py")
    ref = dtrun("-np", "2", "--oversubscribe", PYTHON, example, "--runtime", runtime, "--checkpoint",
                tmp_path / "ref", timeout=180)
    assert ref.returncode == 0, ref.stderr
    p = dtrun("-np", "2", "--oversubscribe", "--max-restarts", "1", PYTHON, example, "--runtime", runtime,
              "--checkpoint", tmp_path / "ckpt", "--crash-at", "8", timeout=180)
    assert p.returncode == 0, p.stderr
    assert "dtrun: attempt 2 of 2: rank 1 on " in p.stderr
    assert "attempt 1: 2 ranks, resumed from step 5" in p.stdout
    final = [line for line in p.stdout.splitlines() if line.startswith("final w")]
    assert final == [line for line in ref.stdout.splitlines() if line.startswith("final w")] and final


def test_a_launcher_that_ended_by_itself_is_named_as_it_ran():
    # the attempt line names the launcher that ran: srun, mpiexec.hydra, or mpirun
    assert failure_of(result(mpirun=3, launcher="srun")).what == "srun exited with code 3"
    assert failure_of(result(mpirun=-9, launcher="mpiexec.hydra")).what == \
        "mpiexec.hydra was killed by SIGKILL"
    assert failure_of(result(mpirun=255)).what == "mpirun exited with code 255"


# ---- the run's rules: one --timeout for all attempts, no loop on alternating failures --------

FAIL_BY_ATTEMPT = ("import os, sys, time\nn = int(os.environ['DTRUN_RESTART_COUNT'])\n"
                   "time.sleep(float(os.environ.get('NAP', '0')))\nsys.exit(int(os.environ['CODES'].split(',')[n]))\n")


@pytest.mark.mpi
def test_timeout_is_the_runs_across_attempts():
    """--timeout 5 with attempts that each fail after 3 s: the second attempt gets the 2 s that
    are left and is stopped (exit 124); a third never starts (it could not before 6 s)."""
    from tests.dtrun_helpers import user_env

    p = dtrun("-np", "1", "--max-restarts", "3", "--timeout", "5", PYTHON, "-c", FAIL_BY_ATTEMPT,
              env=user_env(NAP="3", CODES="3,4,5,6"), timeout=120)
    assert p.returncode == ExitCode.TIMEOUT, p.stderr
    assert "--timeout 5" in p.stderr and "attempt 3 of 4" not in p.stderr, p.stderr


@pytest.mark.mpi
def test_a_failure_seen_again_after_another_is_not_restarted_again():
    """Failures A, B, A on healthy hosts: the second A is the program's own; no fourth attempt."""
    from tests.dtrun_helpers import user_env

    p = dtrun("-np", "1", "--max-restarts", "5", PYTHON, "-c", FAIL_BY_ATTEMPT,
              env=user_env(CODES="3,4,3,4,3,4"), timeout=120)
    assert p.returncode == 3, p.stderr
    assert "dtrun: not restarting: the same failure again (as in attempt 1)" in p.stderr, p.stderr
    assert "attempt 4 of 6" not in p.stderr


@pytest.mark.parametrize("args, needles", [
    (("--on-hang", "restart"), ("--on-hang restart", "add --hang-timeout S and --max-restarts N")),
    (("--on-hang", "restart", "--hang-timeout", "5"), ("--on-hang restart", "add --max-restarts N")),
    (("--on-hang", "restart", "--max-restarts", "1"), ("--on-hang restart", "add --hang-timeout S")),
    (("--max-restarts", "1", "--spares", "bad/host:1"), ("--spares",)),
])
def test_restart_rules_misused_are_one_line_errors(args, needles):
    line = one_line_error(dtrun("-H", "localhost:2", *args, "true", timeout=60), *needles)
    assert "-H:" not in line


def test_a_rank_open_mpi_reports_killed_is_not_called_an_abort():
    """Open MPI's "process rank 1 with PID … on node h2 exited on signal 9" is a kill, not an
    MPI_Abort: the summary must not say "rank 1 aborted the job"."""
    from dtrun.launcher.job.parsers import fallback_failure

    killed = fallback_failure("prterun noticed that process rank 1 with PID 4242 on node h2 exited on "
                              "signal 9 (Killed).\n")
    assert (killed.rank, killed.host, killed.signum, killed.code) == ("1", "h2", 9, None)
    aborted = fallback_failure('prterun has exited due to process rank 1 with PID 0 on node h2 calling\n"abort".\n')
    assert (aborted.rank, aborted.host, aborted.signum) == ("1", "h2", None)
