"""Restarts: time from a lost host to the first step of the next attempt, step by step.

On namespace hosts (tests/nscluster/; needs root): N hosts with one slot each, ``-np N-1``
(the last host is the spare), examples/train_resume.py with a checkpoint. When step 6 is
printed, one host crashes (every process in its namespace killed, then all its traffic
dropped). dtrun (``--max-restarts 1``) runs in a child process of this script, in-process
through ``launcher.run.launch`` so its ``Timings`` come back; this process records the fault
and the first step of the next attempt (CLOCK_MONOTONIC is the same for both). Split into
detection (fault to the end of the attempt), check (the host check: a host the failure
names as lost is left out unchecked, a host whose kill agent answers within a second passes,
the others get the quick ssh check), cleanup (the wait, after the check, for the kill agents
on the hosts the next attempt may use: they start when the attempt ends, and on the host
left out they end in the background) and relaunch (the rest: preflight, mpirun, the
program's start and its first step).
Compared with the same relaunch by hand: bare mpirun on the reduced host list, started at
once, to its first step (a person adds the minutes it takes to notice, find the host and
edit the list).

    python benchmarks/bench_restarts.py [--hosts 3]     # make bench (3), make bench-scale (16)

Writes bench-results/restarts-<N>.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.dtrun_helpers import BIN, PYTHON, user_env  # noqa: E402

REPS = int(os.environ.get("BENCH_REPS", "3"))
EXAMPLE = str(REPO / "examples" / "train_resume.py")


def child(argv_json: str, out_json: str) -> int:
    """Run dtrun's launch in this process and write the restart timings."""
    from dtrun.checks.hostcheck import check_hosts
    from dtrun.checks.preflight import preflight
    from dtrun.launcher.hosts import HostOptions
    from dtrun.launcher.launch import LaunchOptions
    from dtrun.launcher.run import Timings, launch

    kw = json.loads(argv_json)
    hosts = HostOptions(host_list=kw.pop("host_list"), ssh_config=kw.pop("ssh_config"))
    opts = LaunchOptions(program=tuple(kw.pop("program")), hosts=hosts, **kw)
    t = Timings()
    rc = launch(opts, preflight, check_hosts, timings=t)
    Path(out_json).write_text(json.dumps({"rc": int(rc), **{k: getattr(t, k) for k in
                                                            ("detected", "check", "cleanup", "relaunched")}}))
    return int(rc)


def one_run(cluster, tmp: Path, i: int) -> dict:
    from tests.test_restarts_cluster import lose, revive

    hosts = cluster.hosts
    victim = hosts[1]
    ckpt = tmp / f"ckpt{i}"
    kw = {"program": [PYTHON, EXAMPLE, "--checkpoint", str(ckpt), "--steps", "20", "--step-time", "0.2"],
          "host_list": ",".join(f"{h.name}:1" for h in hosts), "np": str(len(hosts) - 1),
          "ssh_config": str(cluster.ssh_config), "tag_output": False, "max_restarts": 1}
    out_json = tmp / f"timings{i}.json"
    p = subprocess.Popen([PYTHON, __file__, "--child", json.dumps(kw), str(out_json)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=user_env(), cwd=REPO)
    err: list = []
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    fault = first_step = None
    restarted = False
    try:
        for line in p.stdout:
            if fault is None and line.startswith("step 6 "):
                fault = time.monotonic()  # the kill comes first in lose(); the traffic drop follows
                lose(victim)
            elif line.startswith("attempt 1:"):
                restarted = True
            elif restarted and first_step is None and line.startswith("step "):
                first_step = time.monotonic()
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
        revive(cluster, victim)
    if p.returncode != 0 or first_step is None:
        raise SystemExit(f"run {i}: dtrun exited {p.returncode}:\n{''.join(err)[-3000:]}")
    t = json.loads(out_json.read_text())
    detected, check, cleanup = t["detected"][0], t["check"][0], t["cleanup"][0]
    return {"detection": detected - fault, "check": check, "cleanup": cleanup,
            "relaunch": first_step - (detected + check + cleanup), "total": first_step - fault}


def by_hand(cluster, tmp: Path, i: int) -> float:
    """Bare mpirun on the reduced host list (the lost host left out by hand): start to first step."""
    hosts = [h for j, h in enumerate(cluster.hosts) if j != 1]
    return bare_first_step(cluster, hosts, [PYTHON, EXAMPLE, "--checkpoint", str(tmp / f"hand{i}"), "--steps", "3"])


def bare_first_step(cluster, hosts, program, extra=()) -> float:
    """Seconds from starting bare mpirun with ``program`` on ``hosts`` (one rank each) to its
    first ``step`` line (benchmarks/bench_elastic.py uses it too)."""
    argv = [str(BIN / "mpirun"), "--allow-run-as-root", "--prtemca", "plm_ssh_args", f"-F {cluster.ssh_config}",
            "--prtemca", "prte_if_include", cluster.subnet, "--mca", "btl_tcp_if_include", cluster.subnet,
            "--mca", "pml", "ob1", "--mca", "btl", "self,tcp", "-H", ",".join(f"{h.name}:1" for h in hosts),
            "-np", str(len(hosts)), *extra, *program]
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=user_env(),
                         start_new_session=True)
    first = None
    for line in p.stdout:
        if first is None and line.startswith("step "):
            first = time.monotonic() - t0
    p.wait(timeout=120)
    if first is None:
        raise SystemExit(f"bare mpirun printed no step (exit {p.returncode})")
    return first


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=3, help="hosts running ranks (one more is the spare)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_restarts: needs root (namespace hosts); skipped")
        return 0
    import tempfile

    from tests.nscluster import Cluster

    cluster = Cluster(args.hosts + 1).up()
    runs, hand = [], []
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in range(REPS):
                runs.append(one_run(cluster, Path(d), i))
                hand.append(by_hand(cluster, Path(d), i))
    finally:
        cluster.down()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    hand_med = statistics.median(hand)
    lines = [f"# Restarts: lost host to the next attempt's first step ({args.hosts} hosts + 1 spare, "
             f"median of {REPS})", "", "| step | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in med.items()]
    lines += [f"| by hand: bare mpirun on the reduced host list, start to first step | {hand_med:.2f} |", "",
              "detection: the fault to the end of the attempt; check: the host the failure names as lost is left "
              "out unchecked, a host whose kill agent answers within 1 s passes, the others get the ssh banner "
              "check (2 s limit); cleanup: the rest of the wait for the kill agents on the hosts the next attempt "
              "may use; relaunch: preflight, mpirun (its daemons through the run's ssh connections), the "
              "program's start and first step. By hand adds the time a person needs to notice."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    (out / f"restarts-{args.hosts}.md").write_text(text)
    (out / f"restarts-{args.hosts}.json").write_text(json.dumps({"runs": runs, "by_hand": hand, "median": med,
                                                                 "by_hand_median": hand_med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
