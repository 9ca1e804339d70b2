"""Elastic runs (``hvd.elastic``): what a commit costs, how long a lost host and a joining host take.

* **Commit cost**, per MB of state: ``state.commit()`` of a ``TorchState`` whose model holds 1,
  16 and 64 MB of float32 parameters, under ``dtrun --max-restarts 1`` on 2 local ranks (so
  the commit is kept on the host's disk), median of 7 commits; beside it the checkpoint file
  of today's restarts (``collectives.dp.save_checkpoint``: rank 0 writes, fsync, rename).
* **Recovery** on namespace hosts (3 hosts + 1 spare, examples/elastic_torch.py, a commit
  every 2 steps): a host crashes (every process in its namespace killed, its traffic
  dropped) after step 10; the time from the fault to the first step of the next attempt,
  which resumes from the last commit.
* **Join**: the discovery script lists 2 hosts, then a third; the time from the change to
  the first step on 3 ranks, split into notice (dtrun sees the change and posts it), leave
  (the job reaches its next commit and ends) and relaunch. Beside it, a bare mpirun of the
  same program on the 3 hosts, start to first step (what a restart by hand costs at least).

    python benchmarks/bench_elastic.py          # make bench

Writes bench-results/elastic.md and .json.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from tests.dtrun_helpers import DTRUN, PYTHON, result_records, user_env  # noqa: E402

REPS = int(os.environ.get("BENCH_REPS", "3"))
EXAMPLE = str(REPO / "examples" / "elastic_torch.py")
SIZES_MB = (1, 16, 64)


def commit_child() -> int:
    """Under dtrun: time commits and checkpoint saves of each size (rank 0 prints RESULT)."""
    import torch

    import dtrun.collectives.horovod.torch as hvd
    from dtrun.collectives import dp

    hvd.init()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for mb in SIZES_MB:
            model = torch.nn.Linear(mb * 1024 * 256, 1, bias=False)  # mb MB of float32
            state = hvd.elastic.TorchState(model=model, optimizer=None, step=0)
            commits, saves = [], []
            for i in range(7):
                hvd.barrier()
                t0 = time.perf_counter()
                state.commit()
                commits.append(time.perf_counter() - t0)
                hvd.barrier()
                t0 = time.perf_counter()
                dp.save_checkpoint(os.path.join(d, "ckpt"), {"model": model.state_dict(), "step": i})
                saves.append(time.perf_counter() - t0)
            out[mb] = {"commit": statistics.median(commits), "checkpoint": statistics.median(saves)}
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    return 0


def commit_cost() -> dict:
    p = subprocess.run([DTRUN, "-np", "2", "--max-restarts", "1", "--no-tag-output", PYTHON, __file__,
                        "--commit-child"], capture_output=True, text=True, env=user_env(), cwd=REPO, timeout=600)
    recs = result_records(p.stdout)
    if p.returncode != 0 or not recs:
        raise SystemExit(f"commit bench failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return recs[0]


def _start(cluster, *args) -> subprocess.Popen:
    argv = [DTRUN, "--ssh-config", str(cluster.ssh_config), "--no-tag-output", "--horovod", *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=user_env(),
                            cwd=REPO, stdin=subprocess.DEVNULL)


def _stderr_times(p: subprocess.Popen, marks: dict, patterns: dict) -> list:
    """Read ``p``'s stderr in a thread, noting when each pattern's first line arrives."""
    lines: list = []

    def read():
        for line in p.stderr:
            lines.append(line)
            for key, text in patterns.items():
                if key not in marks and text in line:
                    marks[key] = time.monotonic()
    threading.Thread(target=read, daemon=True).start()
    return lines


def recovery(cluster) -> float:
    from tests.test_restarts_cluster import lose, revive

    victim = cluster.hosts[1]
    p = _start(cluster, "-H", ",".join(f"{h.name}:1" for h in cluster.hosts), "-np", len(cluster.hosts) - 1,
               "--max-restarts", "1", PYTHON, EXAMPLE, "--steps", "40", "--step-time", "0.1")
    err = _stderr_times(p, {}, {})
    fault = first = None
    resumed = False
    try:
        for line in p.stdout:
            if fault is None and line.startswith("step 10 "):
                fault = time.monotonic()  # the kill comes first in lose(); the traffic drop follows
                lose(victim)
            elif fault is not None and line.startswith("start at step"):
                resumed = True
            elif resumed and first is None and line.startswith("step "):
                first = time.monotonic()
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
        revive(cluster, victim)
    if p.returncode != 0 or first is None:
        raise SystemExit(f"recovery run: dtrun exited {p.returncode}:\n{''.join(err)[-3000:]}")
    return first - fault


def join(cluster, tmp: Path, i: int) -> dict:
    a, b, c = cluster.hosts[:3]
    listing = tmp / f"hosts{i}.txt"
    listing.write_text(f"{a.name}:1\n{b.name}:1\n")
    script = tmp / f"discover{i}.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    p = _start(cluster, "--host-discovery-script", script, "--max-np", "3", PYTHON, EXAMPLE, "--steps", "60",
               "--step-time", "0.1")
    marks: dict = {}
    err = _stderr_times(p, marks, {"notice": "dtrun: hosts changed:", "left": "dtrun: the hosts changed ("})
    change = first = None
    try:
        for line in p.stdout:
            if change is None and line.startswith("step 10 "):
                listing.write_text(f"{a.name}:1\n{b.name}:1\n{c.name}:1\n")
                change = time.monotonic()
            elif change is not None and first is None and line.startswith("step ") and line.rstrip().endswith(
                    "ranks 3"):
                first = time.monotonic()
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    if p.returncode != 0 or first is None or len(marks) < 2:
        raise SystemExit(f"join run: dtrun exited {p.returncode}:\n{''.join(err)[-3000:]}")
    return {"notice": marks["notice"] - change, "leave": marks["left"] - marks["notice"],
            "relaunch": first - marks["left"], "total": first - change}


def by_hand(cluster) -> float:
    """Bare mpirun of the example on 3 hosts: start to first step."""
    from bench_restarts import bare_first_step

    alias = REPO / "collectives" / "horovod" / "_alias"
    return bare_first_step(cluster, cluster.hosts[:3], [PYTHON, EXAMPLE, "--steps", "3"], ("-x", f"PYTHONPATH={alias}"))


def main() -> int:
    if sys.argv[1:] == ["--commit-child"]:
        return commit_child()
    try:
        import torch  # noqa: F401
    except ImportError:
        print("bench_elastic: PyTorch is not installed; skipped")
        return 0
    cost = commit_cost()
    lines = ["# Elastic runs", "", "## Commit cost (2 local ranks; one commit per host, kept on its disk)", "",
             "| state | `state.commit()` ms | ms per MB | checkpoint file (dp.save_checkpoint) ms | ms per MB |",
             "|---:|---:|---:|---:|---:|"]
    for mb in SIZES_MB:
        c = cost[str(mb)]
        lines.append(f"| {mb} MB | {c['commit'] * 1e3:.1f} | {c['commit'] * 1e3 / mb:.2f} | "
                     f"{c['checkpoint'] * 1e3:.1f} | {c['checkpoint'] * 1e3 / mb:.2f} |")
    result = {"commit": cost}
    if os.geteuid() == 0:
        from tests.nscluster import Cluster

        cluster = Cluster(4).up()
        rec, joins, hand = [], [], []
        try:
            with tempfile.TemporaryDirectory() as d:
                for i in range(REPS):
                    rec.append(recovery(cluster))
                    joins.append(join(cluster, Path(d), i))
                    hand.append(by_hand(cluster))
        finally:
            cluster.down()
        jmed = {k: statistics.median(j[k] for j in joins) for k in joins[0]}
        lines += ["", f"## Recovery and join on namespace hosts (median of {REPS})", "", "| figure | seconds |",
                  "|---|---:|",
                  f"| a host lost (3 hosts + 1 spare): fault to the first step after the last commit | "
                  f"{statistics.median(rec):.2f} |",
                  f"| a host added (2 to 3 ranks): listing changed to the first step on 3 ranks | {jmed['total']:.2f} |",
                  f"| &nbsp;&nbsp;notice: dtrun sees the change, checks the host, posts it | {jmed['notice']:.2f} |",
                  f"| &nbsp;&nbsp;leave: the job reaches its next commit and ends | {jmed['leave']:.2f} |",
                  f"| &nbsp;&nbsp;relaunch: the next attempt's start, resume and first step | {jmed['relaunch']:.2f} |",
                  f"| by hand: bare mpirun on the 3 hosts, start to first step | {statistics.median(hand):.2f} |"]
        result.update(recovery=rec, join=joins, by_hand=hand)
    else:
        lines += ["", "Recovery and join: need root (namespace hosts); skipped."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "elastic.md").write_text(text)
    (out / "elastic.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
