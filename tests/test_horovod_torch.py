"""dtrun.collectives.horovod.torch: Horovod's PyTorch API on real ranks under dtrun (1, 2, 3
ranks, and 2 namespace hosts x 2 ranks). tests/horovod_torch_cases.py is the rank program:
every collective and its _async form against NumPy for Horovod's dtypes, matching by name,
the mismatched-shape error, join, objects, the unsupported API, SyncBatchNorm training
equal to BatchNorm on the whole batch, and gradient_predivide_factor."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.dtrun_helpers import DTRUN, REPO, user_env
from tests.horovod_common import (assert_trained_alike, driver_tests, example_line, load_ranks,
                                   results)

PYTHON = sys.executable
CASES = str(REPO / "tests" / "horovod_torch_cases.py")
SHUTDOWN_CASES = str(REPO / "tests" / "horovod_shutdown_cases.py")


def _check(found: list[dict], out, n: int) -> None:
    for res in found:
        assert res["size"] == n
        assert res["failures"] == [], res["failures"]
        assert res["checked"] > 600  # every dtype x op x form ran
        # every rank sees root's object and every rank's, in rank order
        assert res["objects"] == [{"from": n - 1, "epoch": 3}, [[r, "x" * r] for r in range(n)]]
        assert res["join_last"] == 0  # rank 0 joined after the others
        assert res["elastic"] == [True, 1, ["ElasticSampler", "ObjectState", "TorchState", "run"]]
        assert res["queries"][:5] == [True, True, False, False, True]
        if n > 1:
            # the last rank passed shape (4,), the others (3,): the same line everywhere
            assert res["mismatch"] == (
                f"allreduce on rank {res['rank']}: allreduce 'allreduce.grads.w' has shape "
                f"(4,) on rank {n - 1} but (3,) on rank 0")
            # float16 sum of 60000 x n overflows; predivided by n it does not
            assert res["predivide"]["1.0"] == [float("inf")] * 4
            assert res["predivide"][str(float(n))] == [60000.0] * 4
        else:
            assert res["mismatch"] is None
    ranks = load_ranks(out, n)
    keys = [k[5:] for k in ranks[0] if k.startswith("dist.")]
    assert any("running_var" in k for k in keys)
    # N ranks x B/N rows with SyncBatchNorm == 1 process x B rows with BatchNorm
    assert_trained_alike(ranks, [(f"dist.{k}", f"ref.{k}") for k in keys])


def _check_two_hosts(found: list[dict]) -> None:
    assert {tuple(r["queries"][5:]) for r in found} == {(2, 2)}  # local_size, cross_size


test_horovod_torch_ranks, test_horovod_torch_two_hosts = driver_tests(
    CASES, _check, 300, _check_two_hosts)


# ----------------------------------------------------------------------------- shutdown
def _two_ranks(case: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """tests/horovod_shutdown_cases.py CASE on 2 ranks. A job still running after
    ``timeout`` seconds hung: dtrun is stopped with SIGTERM (it stops its ranks) and the
    test fails."""
    argv = [DTRUN, "-np", "2", "-H", "localhost:2", "--oversubscribe", PYTHON, SHUTDOWN_CASES,
            case]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=user_env(), cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        pytest.fail(f"{case}: the job hung ({timeout} s): {out[-2000:]} {err[-2000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _shut_down(got, kind: str, name: str) -> None:
    assert got[0] == "HorovodInternalError", got
    assert got[1].startswith(f"{kind} on rank 0: Horovod has been shut down: rank 1 shut down "), got
    assert f"without running {name!r}" in got[1], got


@pytest.mark.mpi
def test_peer_shutdown_fails_waiting_and_later_collectives():
    # Rank 1 shuts down while rank 0 waits in an allreduce: Horovod's "has been shut
    # down" on rank 0, at once, for that and every later collective; after its own
    # shutdown, Horovod's "not initialized".
    res = results(_two_ranks("shutdown"), 2)[0]
    _shut_down(res["allreduce"], "allreduce", "allreduce.noname.0")
    assert res["waited"] < 30
    _shut_down(res["later allreduce"], "allreduce", "allreduce.later")  # Horovod names it so
    _shut_down(res["barrier"], "barrier", "barrier.noname.0")
    _shut_down(res["broadcast_object"], "broadcast_object", "broadcast_object.noname.0")
    assert res["own shutdown"] == ["ValueError", "allreduce: Horovod has not been initialized; "
                                   "use hvd.init()."]


@pytest.mark.mpi
def test_poll_returns_when_the_peer_program_ended():
    # Rank 1's program ends without hvd.shutdown() (Horovod shuts down at exit) while
    # rank 0 spins on poll(): poll returns True, synchronize raises.
    res = results(_two_ranks("exit"), 2)[0]
    assert res["waited"] < 30
    _shut_down(res["synchronize"], "allreduce", "allreduce.noname.0")


@pytest.mark.mpi
def test_peer_dying_without_finalize_ends_the_job_naming_it():
    # Rank 1 ends without shutdown or MPI_Finalize while rank 0 spins on poll(): the
    # launcher stops the job, naming rank 1.
    proc = _two_ranks("die")
    assert proc.returncode != 0
    assert "dtrun: job failed: rank 1 " in proc.stderr, proc.stderr[-3000:]
    assert "RESULT" not in proc.stdout


@pytest.mark.mpi
def test_a_shutdown_fails_only_what_the_leaving_rank_took_no_part_in():
    # The announcement tells how far the leaving rank got: a rank still inside (or
    # behind) a negotiation the other took part in finishes it; only the next fails.
    r0, r1 = results(_two_ranks("late_news"), 2)
    assert r0["allreduce"] is None and r1["allreduce"] is None
    got = r1["later allreduce"]
    assert got[0] == "HorovodInternalError", got
    assert got[1].startswith("allreduce on rank 1: Horovod has been shut down: rank 0 "), got
    assert "without running 'allreduce.later'" in got[1], got


@pytest.mark.mpi
def test_a_list_where_another_rank_passes_a_tensor_fails_on_every_rank():
    r0, r1 = results(_two_ranks("not_a_tensor"), 2)
    assert r1["allreduce"] == [
        "TypeError", "allreduce on rank 1: expected a torch.Tensor, got list (submitted as "
        "'allreduce.noname.0': the other ranks get a mismatch error)"]
    assert r0["allreduce"] == [
        "HorovodMismatchError",
        "allreduce on rank 0: allreduce 'allreduce.noname.0' is list on rank 1, not a tensor"]
    assert r1["grouped_allreduce"][0] == "TypeError"
    assert r0["grouped_allreduce"] == [
        "HorovodMismatchError", "grouped_allreduce on rank 0: grouped_allreduce "
        "'grouped_allreduce.noname.0' tensor 1 is list on rank 1, not a tensor"]
    assert r0["after"] == r1["after"] == [1.0, 1.0]  # still in step


# ----------------------------------------------------------------------------- pure parts
def test_compare_names_the_rank_and_the_difference():
    from dtrun.collectives.horovod._core import compare

    sig = lambda kind, *shapes, op="sum", root=-1, dt="float32": (  # noqa: E731
        kind, shapes, (dt,) * len(shapes), op, root)
    assert compare("w", [(0, sig("allreduce", (3,))), (1, sig("allreduce", (3,)))]) is None
    assert compare("w", [(0, sig("allreduce", (3,))), (1, sig("allreduce", (3,))),
                         (2, sig("allreduce", (4,)))]) == \
        "allreduce 'w' has shape (4,) on rank 2 but (3,) on rank 0"
    assert compare("w", [(0, sig("allreduce", (3,))), (1, sig("allreduce", (3,), dt="int32"))]) \
        == "allreduce 'w' is int32 on rank 1 but float32 on rank 0"
    assert compare("w", [(0, sig("allreduce", (3,))), (1, sig("allreduce", (3,), op="avg"))]) \
        == "allreduce 'w' uses op Average on rank 1 but Sum on rank 0"
    assert compare("g", [(0, sig("allgather", (2, 3))), (1, sig("allgather", (5, 3)))]) is None
    assert "only the first dimension may differ" in compare(
        "g", [(0, sig("allgather", (2, 3))), (1, sig("allgather", (2, 4)))])
    assert compare("b", [(0, sig("broadcast", (1,), root=0)), (1, sig("broadcast", (1,), root=1))]) \
        == "broadcast 'b' has root_rank 1 on rank 1 but 0 on rank 0"
    assert compare("x", [(0, sig("allreduce", (1,))), (1, sig("broadcast", (1,)))]) == \
        "'x' is broadcast on rank 1 but allreduce on rank 0"


def test_split_rows_is_horovods():
    from dtrun.collectives.horovod._core import split_rows

    assert split_rows(10, 4) == [3, 3, 2, 2]
    assert split_rows(2, 3) == [1, 1, 0]
    assert split_rows(6, 3) == [2, 2, 2]


def test_each_module_imports_only_its_framework():
    code = ("import sys, collectives.horovod.{mod}; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules))")
    got = {}
    for mod in ("torch", "tensorflow", "keras"):
        p = subprocess.run([PYTHON, "-c", code.format(mod=mod)], capture_output=True, text=True,
                           timeout=120, cwd=REPO, env=user_env())
        assert p.returncode == 0, p.stderr[-2000:]
        got[mod] = p.stdout.split("\n")[-2]
    assert got["torch"] == "['torch']"
    # (importing TensorFlow 2.16+ imports Keras 3 itself)
    assert got["tensorflow"] in ("['tensorflow']", "['keras', 'tensorflow']")
    assert got["keras"] == "['keras', 'tensorflow']"


def test_elastic_is_there_and_unknown_names_fail_before_init():
    import dtrun.collectives.horovod.torch as hvd

    import dtrun.collectives.horovod.torch.elastic as elastic

    assert hvd.elastic is elastic and callable(elastic.run)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        hvd.no_such_thing  # noqa: B018
    with pytest.raises(ValueError, match="Horovod has not been initialized; use hvd.init"):
        hvd.rank()


@pytest.mark.mpi
def test_horovod_pytorch_example_learns(tmp_path):
    # Horovod's PyTorch MNIST example with only the import changed, 2 ranks.
    last = example_line("horovod_pytorch_mnist.py", "epoch 3:", "--fp16-allreduce", timeout=300)
    assert float(last.split("test accuracy ")[1].rstrip("%")) > 80
