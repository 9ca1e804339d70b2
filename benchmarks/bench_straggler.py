"""The straggler finding and `dtrun top`: what they cost, and how soon a slow rank is named.

1. Recorder overhead of the wait timing: 2 ranks on this host, 8-byte allreduce through
   the same Comm, its flight recorder with the per-collective timing on and off in
   alternating rounds of the same run (the fastest round of each, and the median of the
   paired per-round ratios). Target: at most 1 %.
2. Time to the first finding: on namespace hosts (tests/nscluster/; needs root), 3 hosts x
   2 ranks of the bundled runtime, balanced for a while, then rank 3 turns slow in a named
   function and prints when; `dtrun top --json` runs beside the job. Seconds from the turn
   to the first refresh of top that flags rank 3 (the simulated hosts share this machine's
   clock, so the two times compare).
3. Cost on the job, 6 ranks (3 hosts x 2): the median step time (compute, then an 8-byte
   allreduce) with dtrun's sampling off (DTRUN_STRAGGLER=0), on (the default: what the end
   finding costs every job), and on with `dtrun top` attached. Runs alternate.

Every simulated host shares this machine's cores, and the machine may be shared: the
figures are noisy. Writes bench-results/straggler.md and straggler.json.
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
from tests.dtrun_helpers import BIN, DTRUN, user_env as env  # noqa: E402

from bench_hang import on_off_rounds  # noqa: E402  (benchmarks/ is sys.path[0])

REPS = int(os.environ.get("BENCH_REPS", "3"))
TARGET_OVERHEAD = 0.01

OVERHEAD = r"""import json, sys, time
import numpy as np
from dtrun import collectives
c = collectives.init()
assert c._rec is not None, "no flight recorder: DTRUN_JOB_DIR not set?"
x = np.ones(2, np.float32)  # 8 bytes
out = np.empty_like(x)
iters, rounds = int(sys.argv[1]), int(sys.argv[2])
for _ in range(2000):
    c.allreduce(x, out=out)
on, off = [], []
for r in range(rounds):
    for timed, acc in ((1, on), (0, off)) if r % 2 == 0 else ((0, off), (1, on)):
        c.set_wait_timing(bool(timed))
        c.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            c.allreduce(x, out=out)
        acc.append((time.perf_counter() - t0) / iters)
c.set_wait_timing(True)
if c.rank == 0:
    print(json.dumps({"on": on, "off": off, "path": c.allreduce_path(8)}))
"""

TURN = """import time
import numpy as np
from dtrun import collectives
c = collectives.init()
x = np.ones(8, np.float32)
print("up", flush=True)
BALANCED_S, SLOW_S, FAST_S = float(__import__("sys").argv[1]), 0.3, 0.05


def decode_batch(slow):
    time.sleep(SLOW_S if slow else FAST_S)


t0 = time.time()
turned = False
while time.time() - t0 < BALANCED_S + 25:
    slow = c.rank == 3 and time.time() - t0 > BALANCED_S
    if slow and not turned:
        turned = True
        print(f"TURNED {time.time()}", flush=True)
    decode_batch(slow)
    c.allreduce(x)
"""

STEPS = """import json, time
import numpy as np
from dtrun import collectives
c = collectives.init()
x = np.ones(2, np.float32)
a = np.random.default_rng(c.rank).random((160, 160))
print("up", flush=True)
times = []
for step in range(STEPS_N):
    t0 = time.perf_counter()
    for _ in range(4):
        a = np.tanh(a @ a.T / 160)
    c.allreduce(x)
    times.append(time.perf_counter() - t0)
if c.rank == 0:
    print("STEPS " + json.dumps(times[20:]), flush=True)
"""


def recorder_overhead(iters=5000, rounds=60) -> dict:
    return on_off_rounds(OVERHEAD, iters, rounds)


class Proc:
    """A process whose output lines are kept with the time they arrived (time.time())."""

    def __init__(self, argv, e, cwd):
        self.lines: list = []
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                                  cwd=cwd, stdin=subprocess.DEVNULL)
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait_for(self, pred, n=1, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [(t, ln) for t, ln in list(self.lines) if pred(ln)]
            if len(hits) >= n:
                return hits[n - 1]
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        tail = "\n".join(ln for _, ln in self.lines[-40:])
        raise SystemExit("straggler bench: expected output did not come:\n" + tail)

    def stop(self, timeout=120):
        try:
            return self.p.wait(timeout=timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()


def hosts_arg(cluster, slots=2) -> str:
    return ",".join(f"{h.name}:{slots}" for h in cluster.hosts)


def time_to_finding(cluster, d: Path, balanced_s: float = 8.0) -> float:
    script = d / "turn.py"
    script.write_text(TURN)
    e = env(XDG_CACHE_HOME=str(d / "cache-turn"))
    job = Proc([DTRUN, "--ssh-config", str(cluster.ssh_config), "-H", hosts_arg(cluster), "--no-tag-output",
                "python", str(script), f"{balanced_s:g}"], e, d)
    top = None
    try:
        job.wait_for(lambda ln: ln == "up", n=6)
        top = Proc([DTRUN, "top", "--json", "--interval", "1"], e, d)

        def flagged(ln):
            try:
                s = json.loads(ln).get("straggler")
            except ValueError:
                return False
            return bool(s) and s["ranks"] == [3]

        turned = float(job.wait_for(lambda ln: ln.startswith("TURNED "))[1].split()[1])
        seen = top.wait_for(flagged, timeout=60)[0]
        return seen - turned
    finally:
        if top is not None:
            top.p.terminate()
            top.stop(10)
        job.p.terminate()
        job.stop()


def step_time(cluster, d: Path, mode: str, steps: int = 120) -> float:
    script = d / "steps.py"
    script.write_text(STEPS.replace("STEPS_N", str(steps)))
    e = env(XDG_CACHE_HOME=str(d / f"cache-{mode}"), **({"DTRUN_STRAGGLER": "0"} if mode == "off" else {}))
    job = Proc([DTRUN, "--ssh-config", str(cluster.ssh_config), "-H", hosts_arg(cluster), "--no-tag-output",
                "python", str(script)], e, d)
    top = None
    try:
        job.wait_for(lambda ln: ln == "up", n=6)
        if mode == "top":
            top = Proc([DTRUN, "top", "--interval", "1"], e, d)
        line = job.wait_for(lambda ln: ln.startswith("STEPS "), timeout=300)[1]
    finally:
        if top is not None:
            top.p.terminate()
            top.stop(10)
        rc = job.stop()
    if rc != 0:
        raise SystemExit(f"straggler bench: step job exited {rc}")
    return statistics.median(json.loads(line[len("STEPS "):]))


def main() -> int:
    out_dir = REPO / "bench-results"
    out_dir.mkdir(exist_ok=True)
    res: dict = {"reps": REPS, "cores": os.cpu_count()}
    md = ["| measure | value | target |", "|---|---|---|"]
    try:
        res["recorder"] = rec = recorder_overhead()
        md += [f"| 8-byte allreduce, wait timing on / off (2 ranks, path {rec['path']}, fastest of {rec['rounds']} "
               f"alternating rounds) | {rec['on_us']:.2f} / {rec['off_us']:.2f} us | |",
               f"| wait timing overhead (median of paired rounds {rec['overhead_median_paired'] * 100:+.1f} %) | "
               f"{rec['overhead'] * 100:+.1f} % | ≤ {TARGET_OVERHEAD * 100:.0f} % "
               f"{'✓' if rec['overhead'] <= TARGET_OVERHEAD else '✗'} |"]
    except SystemExit as exc:
        md.append(f"| wait timing overhead | failed: {(str(exc).strip().splitlines() or ['?'])[-1][:200]} | |")
    from tests.nscluster import Cluster, cluster_unavailable_reason

    reason = cluster_unavailable_reason()
    if reason:
        md.append(f"| time to finding, cost of top | skipped: no namespace cluster here ({reason}) | |")
    else:
        cluster = Cluster(3).up()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                d = Path(tmp)
                found = [time_to_finding(cluster, d) for _ in range(REPS)]
                res["time_to_finding_s"] = found
                md.append(f"| rank turns slow → `dtrun top` flags it (6 ranks on 3 hosts, 1 s refresh) | "
                          f"{statistics.median(found):.1f} s (runs: {', '.join(f'{t:.1f}' for t in found)}) | "
                          "a few refreshes |")
                steps: dict = {"off": [], "on": [], "top": []}
                for _ in range(REPS):
                    for mode in steps:
                        steps[mode].append(step_time(cluster, d, mode))
                res["step_s"] = steps
                base = statistics.median(steps["off"])
                for mode, what in (("off", "sampling off (DTRUN_STRAGGLER=0)"), ("on", "sampling on (default)"),
                                   ("top", "sampling on + `dtrun top` attached")):
                    m = statistics.median(steps[mode])
                    md.append(f"| step time, 6 ranks on 3 hosts, {what} | {m * 1e3:.1f} ms "
                              f"({(m / base - 1) * 100:+.1f} %) | |")
        finally:
            cluster.down()
    md += ["", f"Medians of {REPS} runs; every simulated host shares this machine's {os.cpu_count()} cores, and "
           "other work on the machine shows in these figures: treat them as noisy."]
    (out_dir / "straggler.json").write_text(json.dumps(res, indent=2))
    (out_dir / "straggler.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0  # targets are reported, not enforced (timings on a shared machine vary)


if __name__ == "__main__":
    sys.exit(main())
