"""dtrun.collectives.dp (data-parallel PyTorch): equivalence with single-rank training on real
ranks under dtrun, bit-identical parameters on every rank, the error cases, and the
example. Skipped with the reason where PyTorch is not installed."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from tests.dtrun_helpers import REPO, dtrun, ports_dropped, result_records, the_one_line, user_env

torch = pytest.importorskip("torch", reason="PyTorch is not installed (collectives.dp needs it)")
PYTHON = sys.executable


def launch(n: int, *program: str, timeout: float = 180, env_vars: dict | None = None):
    forwards = []
    for name in env_vars or {}:
        forwards += ["-x", name]
    return dtrun("-np", n, "-H", f"localhost:{n}", "--oversubscribe", *forwards, PYTHON,
                 *program, timeout=timeout, env=user_env(**(env_vars or {})))


def results(proc) -> list[dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = result_records(proc.stdout)
    return sorted(found, key=lambda r: r.get("rank", 0))


# ----------------------------------------------------------------------------- pure parts
def test_shard_partitions_every_item_once_per_seed():
    from dtrun.collectives.dp import shard

    for n_items, size in [(10, 3), (12, 4), (5, 8), (0, 2), (7, 1)]:
        parts = [shard(n_items, seed=5, rank=r, size=size) for r in range(size)]
        assert len({len(p) for p in parts}) <= 1  # same number of steps on every rank
        covered = np.concatenate(parts) if parts else np.array([])
        assert set(covered.tolist()) == set(range(n_items))  # none left out
        padded = len(covered) - n_items
        assert padded == (-n_items) % size  # only the padding repeats
        again = [shard(n_items, seed=5, rank=r, size=size) for r in range(size)]
        assert all(np.array_equal(a, b) for a, b in zip(parts, again))  # same every epoch
    a = shard(100, seed=1, rank=0, size=2)
    assert not np.array_equal(a, shard(100, seed=2, rank=0, size=2))
    assert not np.array_equal(a, shard(100, seed=1, rank=1, size=2))
    uneven = [shard(10, seed=0, even=False, rank=r, size=3) for r in range(3)]
    assert sorted(np.concatenate(uneven).tolist()) == list(range(10))


def test_first_difference_names_parameter_and_rank():
    from dtrun.collectives.dp_context import first_difference

    ref = [("fc.weight", (4, 2), "float32"), ("fc.bias", (4,), "float32")]
    assert first_difference([ref, list(ref)]) is None
    assert first_difference([ref, ref, [ref[0], ("fc.bias", (5,), "float32")]]) == \
        "parameter 'fc.bias' has shape (5,) on rank 2 but (4,) on rank 0"
    assert first_difference([ref, ref[:1]]) == "parameter 'fc.bias' exists on rank 0 but not on rank 1"
    assert first_difference([ref, ref + [("extra", (1,), "float32")]]) == \
        "parameter 'extra' exists on rank 1 but not on rank 0"
    assert "is float64 on rank 1" in first_difference([ref, [("fc.weight", (4, 2), "float64"), ref[1]]])


def test_calling_before_init_says_so():
    proc = subprocess.run([PYTHON, str(REPO / "tests" / "dp_cases.py"), "before-init"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    (res,) = results(proc)
    assert res["error"].startswith("broadcast_parameters on rank ?: called before init()")


def test_bad_arguments_are_one_line_errors(monkeypatch):
    import dtrun.collectives.dp as dp

    ctx = dp.init()  # a singleton MPI job in this process
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (dict(op="max"), "op='max'; use 'avg' or 'sum'"),
        (dict(compression="int8"), "compression='int8'; use Compression.none or Compression.fp16"),
        (dict(backward_passes_per_step=0), "backward_passes_per_step must be >= 1"),
        (dict(named_parameters=[("weight", model.weight)]),
         "1 parameters of the optimizer are not in named_parameters"),
        (dict(named_parameters=[("w", model.weight), ("w", model.bias)]), "parameter names repeat: ['w']"),
    ]
    for kwargs, message in cases:
        with pytest.raises(dp.UsageError) as info:
            dp.DistributedOptimizer(opt, **kwargs)
        assert str(info.value).startswith(f"DistributedOptimizer on rank {ctx.rank}: {message}")
    with monkeypatch.context() as m:
        m.setenv("DTRUN_DP_TRANSPORT", "tcp")
        with pytest.raises(dp.UsageError) as info:
            dp.DistributedOptimizer(opt)
        assert str(info.value) == (f"DistributedOptimizer on rank {ctx.rank}: DTRUN_DP_TRANSPORT is "
                                   "'tcp'; use one of auto, ring, mpi")
        m.setenv("DTRUN_DP_TRANSPORT", "ring")
        m.setenv("DTRUN_DP_RING_PORTS", "80-90")
        with pytest.raises(dp.UsageError) as info:
            dp.DistributedOptimizer(opt)
        assert str(info.value) == (f"DistributedOptimizer on rank {ctx.rank}: DTRUN_DP_RING_PORTS="
                                   "'80-90': expected LOW-HIGH, ports from 1024 to 65535, e.g. "
                                   "47000-47100")
    with pytest.raises(dp.UsageError, match="shard on rank 3: n_items=4, rank=3, size=2 out of range"):
        dp.shard(4, rank=3, size=2)
    wrapped = dp.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    assert isinstance(wrapped, torch.optim.SGD) and wrapped.param_groups is opt.param_groups


# ----------------------------------------------------------------------------- equivalence
def _train(n: int, tmp_path, *extra, env_vars=None) -> list[dict]:
    out = tmp_path / f"np{n}"
    script = str(REPO / "tests" / "dp_train.py")
    if n == 1:
        proc = subprocess.run([PYTHON, script, str(out), *extra], capture_output=True,
                              text=True, timeout=180, cwd=REPO)
    else:
        proc = launch(n, script, str(out), *extra, env_vars=env_vars)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [dict(np.load(out / f"rank.{r}.npz")) for r in range(n)]
    assert all(int(r["size"]) == n for r in ranks)
    return ranks


def _check_equivalent(ranks: list[dict], rtol: float, atol: float) -> None:
    keys = [k[:-5] for k in ranks[0] if k.endswith("-dist")]
    assert len(keys) == 8  # {mlp, cnn} x {sgd, adam} x accumulation {1, 2}
    for key in keys:
        ref, dist = ranks[0][f"{key}-ref"], ranks[0][f"{key}-dist"]
        assert np.abs(ref).max() > 0.1  # a real, trained model
        np.testing.assert_allclose(dist, ref, rtol=rtol, atol=atol, err_msg=key)
        for r, other in enumerate(ranks[1:], start=1):  # bit-identical on every rank
            assert other[f"{key}-dist"].tobytes() == dist.tobytes(), f"{key}: rank {r} differs"


def test_one_rank_equals_plain_pytorch(tmp_path):
    _check_equivalent(_train(1, tmp_path), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_two_ranks_equal_one_rank_many_buckets_shared_memory(tmp_path):
    # Tiny buckets (one or two parameters each, several allreduces in flight) and the
    # shared-memory allreduce for all of them (threshold lowered below the bucket sizes).
    ranks = _train(2, tmp_path, "--bucket-bytes", "256", env_vars={"DTRUN_SHM_THRESHOLD": "1"})
    _check_equivalent(ranks, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_four_ranks_equal_one_rank(tmp_path):
    _check_equivalent(_train(4, tmp_path), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_fp16_compression_close_to_one_rank(tmp_path):
    ranks = _train(2, tmp_path, "--compression", "fp16")
    _check_equivalent(ranks, rtol=0, atol=2e-2)


def _on_hosts(cluster, spec: str, out, *extra, env: tuple[str, ...] = ()) -> list[dict]:
    p = dtrun("--ssh-config", cluster.ssh_config, "-H", spec, *env, PYTHON,
              str(REPO / "tests" / "dp_train.py"), str(out), *extra, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    n = sum(int(part.rsplit(":", 1)[1]) for part in spec.split(","))
    return [dict(np.load(out / f"rank.{r}.npz")) for r in range(n)]


# Ranks per host, and bytes per bucket: tiny buckets, many of them in flight at once.
RING_LAYOUTS = {
    "2x2": ((2, 2), 4096),  # shared memory within a host (fp16: summed in float32 there)
    "3x1": ((1, 1, 1), 5000),  # a ring of 3, buckets whose sizes 3 does not divide
    "2+1": ((2, 1), 4096),  # uneven: the lone rank is its host's leader
}


@pytest.mark.cluster
@pytest.mark.mpi
@pytest.mark.parametrize("compression", ["none", "fp16"])
@pytest.mark.parametrize("layout", list(RING_LAYOUTS))
def test_ring_between_hosts_equals_one_rank(cluster3, tmp_path, layout, compression):
    per_host, bucket = RING_LAYOUTS[layout]
    spec = ",".join(f"{h.name}:{n}" for h, n in zip(cluster3.hosts, per_host))
    ranks = _on_hosts(cluster3, spec, tmp_path / layout, "--bucket-bytes", str(bucket),
                      "--compression", compression)
    assert {str(r["transports"]) for r in ranks} == {"ring"}
    if compression == "fp16":
        _check_equivalent(ranks, rtol=0, atol=2e-2)
    else:
        _check_equivalent(ranks, rtol=1e-5, atol=1e-6)


@pytest.mark.cluster
@pytest.mark.mpi
def test_a_ring_the_firewall_blocks_falls_back_to_mpi_in_one_line(cluster3, tmp_path):
    # The ring may listen only on 47000-47010, and the second host's firewall drops those
    # ports (MPI's own ports stay open): rank 0 cannot reach it, every rank learns so, and
    # the job goes on through MPI with one line saying why.
    h1, h2 = cluster3.hosts[:2]
    with ports_dropped(cluster3, h2, "47000-47010"):
        p = dtrun("--ssh-config", cluster3.ssh_config, "-H", f"{h1.name}:1,{h2.name}:1",
                  "-x", "DTRUN_DP_RING_PORTS=47000-47010", PYTHON,
                  str(REPO / "tests" / "dp_train.py"), str(tmp_path / "fw"),
                  "--bucket-bytes", "4096", timeout=240)
    said = the_one_line(p, "dtrun.collectives.dp:")
    assert re.search(rf"collectives\.dp: rank 0 could not join the ring between hosts: "
                     rf"{re.escape(h2.addr)}:470\d\d: timed out; gradients go through MPI "
                     r"between hosts instead$", said), said
    ranks = [dict(np.load(tmp_path / "fw" / f"rank.{r}.npz")) for r in range(2)]
    assert {str(r["transports"]) for r in ranks} == {"runtime"}
    _check_equivalent(ranks, rtol=1e-5, atol=1e-6)


@pytest.mark.cluster
@pytest.mark.mpi
def test_two_hosts_through_mpi_when_asked(cluster3, tmp_path):
    # DTRUN_DP_TRANSPORT=mpi: the runtime's allreduce (MPI over TCP between the hosts),
    # with the threshold lowered so every bucket takes the hierarchical path
    names = [h.name for h in cluster3.hosts[:2]]
    ranks = _on_hosts(cluster3, f"{names[0]}:2,{names[1]}:1", tmp_path / "mpi",
                      "--bucket-bytes", "4096",
                      env=("-x", "DTRUN_DP_TRANSPORT=mpi", "-x", "DTRUN_SHM_THRESHOLD=1"))
    assert {str(r["transports"]) for r in ranks} == {"runtime"}
    _check_equivalent(ranks, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- behaviours
@pytest.mark.mpi
def test_mismatched_parameters_fail_on_every_rank_naming_them():
    res = results(launch(2, str(REPO / "tests" / "dp_cases.py"), "mismatch", timeout=120))
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r["error"] == (f"DistributedOptimizer on rank {r['rank']}: parameter 'a.weight' "
                              "has shape (16, 4) on rank 1 but (8, 4) on rank 0; every rank must "
                              "build the same model and pass the same parameters")


@pytest.mark.mpi
def test_parameter_without_gradient_on_one_rank_does_not_hang():
    res = results(launch(2, str(REPO / "tests" / "dp_cases.py"), "unused", timeout=120))
    assert [r["rank"] for r in res] == [0, 1]
    r0, r1 = res
    assert r1["b_local"] is None  # rank 1 never used branch b ...
    assert r0["b_grad"] == pytest.approx(r0["b_local"] / 2)  # ... so it counts as zeros
    assert r1["b_grad"] == r0["b_grad"]
    assert r0["never_grad_none"] and r1["never_grad_none"]  # unused everywhere: None
    assert r0["checksum"] == r1["checksum"]


@pytest.mark.mpi
def test_two_optimizers_in_one_backward_pass():
    res = results(launch(3, str(REPO / "tests" / "dp_cases.py"), "two", timeout=120))
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert all(r["diff"] < 1e-6 for r in res), res
    assert len({r["checksum"] for r in res}) == 1


@pytest.mark.mpi
def test_synchronize_then_clip_then_step():
    res = results(launch(2, str(REPO / "tests" / "dp_cases.py"), "clip", timeout=120))
    for r in res:
        assert r["norm_before"] > 1.0 and r["norm_after"] == pytest.approx(1.0, rel=1e-5)
        assert "more than backward_passes_per_step=1 times before step()" in r["double_backward"]
    assert res[0]["norm_before"] == res[1]["norm_before"]  # the clipped gradient is the average


@pytest.mark.mpi
def test_step_steps_each_bucket_as_it_is_averaged_with_the_whole_steps_bits():
    # step() runs the optimizer's own step once per bucket (2 here) as each bucket is
    # averaged, plus once for what is in no bucket (a parameter whose gradient is set by
    # hand); a gathered sparse gradient's bucket waits for the end; parameter groups are
    # kept (a step leaves out the groups with none of its parameters); an error in the
    # optimizer's own step is raised once the step's buckets are all done. A step hook forces the
    # one whole step (hooks must run once per step), and the parameters must be the same
    # bits either way, for every optimizer stepped a bucket at a time.
    res = results(launch(2, str(REPO / "tests" / "dp_cases.py"), "step-each", timeout=180))
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r["buckets"] == 2
        assert r["exact"] == {"sgd": True, "adam": True, "adamw": True, "rmsprop": True,
                              "adagrad": True, "sgd-sparse": True, "adam-groups": True}
        assert r["calls"] == {"sgd": {"each": [3] * 4, "whole": [1] * 4},
                              "sgd-sparse": {"each": [2] * 4, "whole": [1] * 4}}
        # the optimizer's own step raised on the first bucket: step() raised it only once
        # the last bucket (its allreduce made slow) was done, and training went on
        assert r["failed_step"] == {"error": "boom", "slow_bucket_done": 1,
                                    "same_everywhere": True}


@pytest.mark.mpi
def test_broadcasts_metric_and_shard():
    res = results(launch(2, str(REPO / "tests" / "dp_cases.py"), "api", timeout=120))
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r["obj"] == {"epoch": 7, "rank": 0}
        assert r["metric"] == 0.5 and r["tmetric"] == [1.0, 2.0]
        assert r["shard"] == r["shard_again"]
        assert r["lr"] == 0.5 and r["step"] == 1.0  # root's optimizer state everywhere
        assert r["is_adam"]  # the wrapper is still an Adam (LR schedulers accept it)
    assert sorted(res[0]["shard"] + res[1]["shard"]) == list(range(10))


# ----------------------------------------------------------------------------- example
@pytest.mark.mpi
def test_example_reaches_single_rank_accuracy():
    script = str(REPO / "examples" / "train_mnist_like.py")
    one = subprocess.run([PYTHON, script], capture_output=True, text=True, timeout=180, cwd=REPO)
    four = launch(4, script, timeout=240)
    accs = []
    for proc in (one, four):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        final = [line for line in proc.stdout.splitlines() if "final test accuracy" in line]
        assert len(final) == 1, proc.stdout  # printed by rank 0 only
        accs.append(float(final[0].split()[-1].rstrip("%")))
    assert accs[0] > 85.0, accs  # the synthetic task is learnable
    assert abs(accs[0] - accs[1]) <= 1.0, accs
