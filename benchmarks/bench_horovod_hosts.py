"""Real Horovod against dtrun's Horovod adapter across two hosts, behind a shaped link.

Needs root, like bench_dp_hosts.py: ``tests.nscluster`` builds 2 namespace hosts on this
machine (1 rank each) and every host's ``eth0`` is shaped with ``tc qdisc replace dev eth0
root tbf rate 500mbit burst 256kbit latency 50ms``, so that the link, not the CPU, bounds
the step. The rank program is bench_horovod.py's ``hvd-mlp`` worker, unchanged under both
engines: bench_ddp.py's MLP (256-1024x4-10, 3.4 M parameters, 13.7 MB of float32
gradients), batch 32 per rank, SGD with momentum, ``import horovod.torch as hvd`` and
``hvd.DistributedOptimizer``, one compute thread per rank (OMP_NUM_THREADS=1):

* ``horovodrun --gloo -np 2 -H h1:1,h2:1`` with real Horovod 0.28.1 (``--real-horovod
  PYTHON``, horovodrun beside it);
* ``dtrun --horovod -np 2 -H h1:1,h2:1 --ssh-config CLUSTER`` (the adapter).

One job per engine and round, the engines taking turns (the first one alternates); a job's
figure is its median step, the max over ranks. The table gives each engine's median over
its jobs, the adapter's speed relative to real Horovod (the median of per-round ratios)
and the link's bound: with 2 hosts a ring sends the whole gradient each way, so one step
needs at least gradient bytes / 500 Mbit/s on the link.

horovodrun reaches hosts with a bare ``ssh HOST`` (and adds its own options); to point it
at the cluster's ssh config without touching ~/.ssh (ssh reads the home directory from the
password database, not $HOME), its PATH starts with a folder whose ``ssh`` runs the real
one with ``-F <cluster ssh_config>``. Host names resolve through /etc/hosts (nscluster's
lines) and every path is the same on both hosts (one file system).

The cluster's names start with ``hvs`` and its subnet is a free 10.63.y.0/24 (tests take
theirs from 10.64-254.y.0/24), so a test suite running beside it never meets it; the
cluster comes down on every exit, failures and SIGTERM included. Writes
bench-results/horovod-hosts.md and .json and prints the table with the load average.

    python benchmarks/bench_horovod_hosts.py --real-horovod PYTHON [--real-rounds N]
        [--rounds N] [--steps N] [--warmup N]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))
from _timing import BIN, OUT_DIR, add_timing_args, timing_argv  # noqa: E402
from bench_horovod import bench_doc, engine_job  # noqa: E402

RATE_BPS = 500e6
SHAPE = ["tbf", "rate", "500mbit", "burst", "256kbit", "latency", "50ms"]
HOSTS = 2
WORKER = HERE / "bench_horovod.py"


@dataclasses.dataclass
class HostsEngine:
    """A launcher for one rank on each of ``hosts`` (what bench_horovod.engine_job runs)."""

    name: str
    launcher: list[str]
    python: str
    hosts: list[str]

    def argv(self, ranks: int) -> list[str]:
        spec = ["-np", str(ranks), "-H", ",".join(f"{h}:1" for h in self.hosts)]
        if self.name == "dtrun":
            from horovod_suite import TAG_VAR

            return [*self.launcher, *spec, "-x", TAG_VAR]
        return [*self.launcher, "--gloo", *spec]


def engines(args, cluster, wrapper_dir: Path) -> dict[str, HostsEngine]:
    """Real Horovod's horovodrun (ssh through the wrapper) and dtrun --horovod, on the cluster."""
    py = Path(args.real_horovod)
    hr = py.parent / "horovodrun"
    names = [h.name for h in cluster.hosts]
    path = f"{wrapper_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return {
        "horovod": HostsEngine("horovodrun", ["env", f"PATH={path}", str(hr)], str(py), names),
        "dtrun": HostsEngine("dtrun", [str(BIN / "dtrun"), "--horovod", "--no-tag-output",
                                       "--ssh-config", str(cluster.ssh_config),
                                       "-x", "OMP_NUM_THREADS=1"], sys.executable, names),
    }


def ssh_wrapper(folder: Path, ssh_config: Path) -> Path:
    """``folder/ssh``: the real ssh with the cluster's config first (for horovodrun)."""
    real = shutil.which("ssh")
    if real is None:
        sys.exit("bench_horovod_hosts: no ssh client on PATH (horovodrun needs one)")
    script = folder / "ssh"
    script.write_text(f'#!/bin/sh\nexec {real} -F "{ssh_config}" "$@"\n')
    script.chmod(0o755)
    return folder


def private_subnet() -> ipaddress.IPv4Network:
    """A free 10.63.y.0/24, outside the 10.64-254.y.0/24 that nscluster gives tests; called
    by Cluster.up under nscluster's allocation lock, like its own picker."""
    from tests.nscluster.common import ClusterError
    from tests.nscluster.namespaces import _used_networks

    used = [u for u in _used_networks() if u.version == 4]
    for y in random.sample(range(256), 256):
        net = ipaddress.ip_network(f"10.63.{y}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise ClusterError("no free 10.63.y.0/24 subnet (checked ip route and ip addr)")


def measure(args, cluster) -> dict:
    """Probe both engines, then alternate MLP jobs; every figure the report needs."""
    from bench_ddp import build_model

    with tempfile.TemporaryDirectory(prefix="bench-hvd-hosts-") as tmp:
        eng = engines(args, cluster, ssh_wrapper(Path(tmp), cluster.ssh_config))
        probe = {n: bench_doc(engine_job(e, [str(WORKER), "--worker", "probe"], 300))
                 for n, e in eng.items()}
        load0 = os.getloadavg()
        steps: dict[str, list[float]] = {n: [] for n in eng}
        walls: dict[str, list[float]] = {n: [] for n in eng}
        for r in range(args.real_rounds):
            for name in (list(eng) if r % 2 == 0 else list(eng)[::-1]):
                t0 = time.monotonic()
                doc = bench_doc(engine_job(eng[name], [str(WORKER), "--worker", "hvd-mlp",
                                                       *timing_argv(args)], 600))
                walls[name].append(round(time.monotonic() - t0, 1))
                steps[name].append(statistics.median(doc["rounds"]))
                print(f"round {r + 1} {name}: {1000 * steps[name][-1]:.1f} ms "
                      f"(job {walls[name][-1]} s)", flush=True)
        load1 = os.getloadavg()
    return {"step_s": steps, "job_wall_s": walls, "threads": probe,
            "grad_bytes": 4 * sum(p.numel() for p in build_model().parameters()),
            "commands": {n: shown(e, args) for n, e in eng.items()},
            "loadavg": [load0, load1], "subnet": cluster.subnet,
            "hosts": [h.name for h in cluster.hosts]}


def shown(engine: HostsEngine, args) -> str:
    """The engine's command line as the table shows it (the wrapper's folder named by role)."""
    argv = [*engine.argv(HOSTS), engine.python, str(WORKER), "--worker", "hvd-mlp", *timing_argv(args)]
    if argv[0] == "env":
        argv[1] = "PATH=<folder with an ssh that adds -F <cluster>/ssh_config>:$PATH"
    return " ".join(argv)


def report(args, doc: dict) -> str:
    """The table (markdown) of ``doc``; also written to bench-results/horovod-hosts.md/.json."""
    med = {n: statistics.median(v) for n, v in doc["step_s"].items()}
    ratio = statistics.median(h / d for h, d in zip(doc["step_s"]["horovod"], doc["step_s"]["dtrun"]))
    bound = doc["grad_bytes"] * 8 / RATE_BPS  # 2 hosts: a ring sends the whole gradient each way
    load0, load1 = doc["loadavg"]
    threads = ", ".join(f"{n}: {p['threads']} ({p['module']})" for n, p in doc["threads"].items())
    head = (f"Real Horovod 0.28.1 against dtrun's adapter, {HOSTS} namespace hosts x 1 rank, each "
            f"host's eth0 `tc qdisc replace dev eth0 root {' '.join(SHAPE)}`; bench_ddp's MLP "
            f"(256-1024x4-10, {doc['grad_bytes'] / 1e6:.1f} MB of float32 gradients), batch 32 "
            f"per rank; {args.real_rounds} alternating jobs per engine, each the median of "
            f"{args.rounds} x {args.steps} steps after {args.warmup} warm-up steps; torch threads "
            f"per rank: {threads}; load average {load0[0]:.2f} before, {load1[0]:.2f} after (1 min)")
    rows = [("link bound: gradient bytes each way / 500 Mbit/s", f"{1000 * bound:.1f} ms", ""),
            ("MLP step, real Horovod 0.28.1 (horovodrun --gloo)", f"{1000 * med['horovod']:.1f} ms",
             f"{med['horovod'] / bound:.2f}x the bound"),
            ("MLP step, dtrun --horovod (adapter)", f"{1000 * med['dtrun']:.1f} ms",
             f"{med['dtrun'] / bound:.2f}x the bound; {ratio:.2f}x real Horovod's speed "
             "(median of per-round ratios)")]
    table = ["| variant | median step | |", "|---|---:|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = head + "\n\n" + "\n".join(table) + "\n\nCommands:\n\n" + "".join(
        f"    {c}\n" for c in doc["commands"].values())
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "horovod-hosts.md").write_text(text)
    (OUT_DIR / "horovod-hosts.json").write_text(json.dumps({**doc, "median_s": med,
                                                            "ratio": ratio, "bound_s": bound}, indent=1))
    return text


def stop_jobs() -> None:
    """Kill every process this one started (a job's launcher, interrupted mid-run)."""
    from horovod_suite import _descendants

    for pid in _descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _sigterm(signum, frame) -> None:
    raise SystemExit(f"bench_horovod_hosts: signal {signum}: tearing the cluster down")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(ap, rounds=2)
    ap.add_argument("--real-horovod", metavar="PYTHON", default=os.environ.get("BENCH_REAL_HOROVOD"),
                    help="the Python where Horovod 0.28.1 is built (horovodrun beside it); "
                    "also $BENCH_REAL_HOROVOD")
    ap.add_argument("--real-rounds", type=int, default=5, help="jobs per engine, alternating")
    args = ap.parse_args()
    py = Path(args.real_horovod or "")
    if not (args.real_horovod and py.is_file() and (py.parent / "horovodrun").is_file()):
        sys.exit(f"bench_horovod_hosts: no Python with horovodrun beside it at "
                 f"{args.real_horovod!r}: give --real-horovod PYTHON, the Python of an "
                 "environment where Horovod 0.28.1 is built")
    if os.geteuid() != 0:
        print("bench_horovod_hosts: needs root (namespace hosts and tc); skipped")
        return 0
    import tests.nscluster.cluster as nscluster_cluster
    from tests.nscluster import Cluster, ClusterUnavailable

    signal.signal(signal.SIGTERM, _sigterm)
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # dtrun's mpirun
    nscluster_cluster._pick_subnet = private_subnet
    try:
        with Cluster(HOSTS, prefix="hvs" + secrets.token_hex(2)) as cluster:
            for h in cluster.hosts:
                cluster.exec(h, ["tc", "qdisc", "replace", "dev", "eth0", "root", *SHAPE], check=True)
            try:
                doc = measure(args, cluster)
            except BaseException:
                stop_jobs()  # a launcher left running; down() ends what runs on the hosts
                raise
    except ClusterUnavailable as e:
        print(f"bench_horovod_hosts: no namespace cluster here ({e}); skipped")
        return 0
    print(report(args, doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
