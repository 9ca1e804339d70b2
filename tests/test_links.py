"""doctor --links on values: which pairs are measured, and who is named (checks/links.py)."""
from dtrun.checks.links import link_findings, plan


def fast(mbps=10000.0, rtt=0.05):
    return {"mbps": mbps, "rtt_ms": rtt, "error": None}


def test_plan_all_pairs_small_ring_and_sample_large():
    names = [f"n{i}" for i in range(1, 5)]
    assert len(plan(names)) == 12 and ("n4", "n1") in plan(names)
    big = [f"n{i}" for i in range(1, 66)]
    pairs = plan(big)
    assert pairs[:65] == [(big[i], big[(i + 1) % 65]) for i in range(65)]  # the ring first
    assert len(pairs) == 130 and len(set(pairs)) == 130 and plan(big) == pairs  # + a sample, deterministic
    assert len(plan(big, sample=0)) == 65
    assert plan(["n1"]) == [] and plan(["a", "b"]) == [("a", "b"), ("b", "a")]


def test_the_slow_sender_is_named_and_nothing_else():
    names = ["a", "b", "c", "d"]
    res = {(x, y): fast(48.0 if x == "c" else 10000.0) for x in names for y in names if x != y}
    found = link_findings(res, names)
    warns = [f for f in found if f.status == "warn"]
    assert [(f.host, f.check) for f in warns] == [("c", "network")]
    assert "c is the outlier sending, at 48 Mb/s against the median 10.0 Gb/s" in warns[0].detail
    assert sorted(f.host for f in found if f.status == "ok") == ["a", "b", "d"]


def test_a_slow_receiver_and_a_slow_pair():
    names = ["a", "b", "c", "d"]
    res = {(x, y): fast(900.0 if y == "d" else 10000.0) for x in names for y in names if x != y}
    [w] = [f for f in link_findings(res, names) if f.status == "warn"]
    assert w.host == "d" and "outlier receiving" in w.detail
    res = {(x, y): fast() for x in names for y in names if x != y}
    res[("a", "b")] = fast(100.0)
    [w] = [f for f in link_findings(res, names) if f.status == "warn"]
    assert w.host == "a" and "slow link: a → b at 100 Mb/s" in w.detail and "while both hosts" in w.detail


def test_noise_below_the_factor_is_not_named_and_errors_are():
    names = ["a", "b", "c"]
    res = {(x, y): fast(10000.0 / (1 + i % 3)) for i, (x, y) in
           enumerate((x, y) for x in names for y in names if x != y)}
    assert all(f.status == "ok" for f in link_findings(res, names))
    res[("a", "c")] = {"mbps": None, "rtt_ms": None, "error": "timed out"}
    [w] = [f for f in link_findings(res, names) if f.status == "warn"]
    assert w.host == "a" and "a → c could not be measured: timed out" in w.detail


def test_suspects_are_measured_again_and_the_better_figure_kept():
    from dtrun.checks.links import better, suspects

    names = ["a", "b", "c"]
    res = {(x, y): fast() for x in names for y in names if x != y}
    res[("a", "b")] = fast(rtt=7.3)  # a hiccup
    res[("b", "c")] = fast(mbps=50.0)
    assert sorted(suspects(res)) == [("a", "b"), ("b", "c")]
    assert better(res[("a", "b")], fast(rtt=0.06))["rtt_ms"] == 0.06
    assert better(res[("b", "c")], fast(mbps=48.0))["mbps"] == 50.0
    assert better({"mbps": None, "rtt_ms": None, "error": "timed out"}, fast())["mbps"] == 10000.0
