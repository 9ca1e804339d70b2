"""Data-parallel training across hosts, behind a shaped link: each figure next to the
link's bound.

Needs root: ``tests.nscluster`` builds namespace hosts on this machine, and every host's
``eth0`` is shaped with ``tc qdisc replace dev eth0 root tbf rate RATE burst 256kbit
latency 50ms`` (what leaves each host goes at RATE: 500 Mbit/s by default, where on 2
hosts the link sets the pace; ``--rate 200mbit`` leaves the cores room on 3 hosts too;
``--rate 2gbit`` is the CPU-bound reference, where the
simulated links' packet work saturates this machine's two cores). Without root it prints
why and exits 0. The model is bench_ddp.py's MLP (3.4 M parameters, 13.7 MB of float32
gradients), batch 32 per rank, one compute thread per rank. Layouts:

* 2 hosts x 1 rank, 3 hosts x 1 rank, 2 hosts x 2 ranks (shared memory inside a host,
  the link between them);
* in each job the variants take turns, round after round (benchmarks/_timing.py), and
  the median step counts: ``ddp`` (torch DDP, gloo), ``dp`` (collectives.dp
  DistributedOptimizer: the TCP ring between hosts), ``dp-after`` (the same, every bucket
  after backward), ``dp-mpi`` (the same through the runtime's allreduce,
  ``DTRUN_DP_TRANSPORT=mpi``), ``fp16`` (dp with Compression.fp16), ``compute``
  (forward, backward and step with no exchange at all); then, once the Horovod adapter's
  engine runs, ``hvd`` (collectives.horovod.torch's DistributedOptimizer) against ``dp``;
* in the same job, bare transfers of the whole gradient (13.7 MB, float32), to show
  what the link itself gives: raw MPI's allreduce, gloo's (torch.distributed) and the
  runtime's, in place and out of place, over all ranks; and over one rank per host, the
  ring's allreduce, and the exchange the bound counts with no arithmetic at all (each host sends 2(n-1)/n of the gradient to the next
  host with MPI_Sendrecv while it receives as much from the previous one).

Each variant's row also gives the share of this machine's CPU time that was busy while it
ran, and the kernel's part of it (system, irq and softirq: the simulated links' packet
work), read from /proc/stat around rank 0's steps: the namespace hosts share this
machine's cores, so where those are saturated the step is bound by CPU, not by the link.

The bound of one step's gradient exchange is the bytes each host must send over its link:
a ring over n hosts sends 2(n-1)/n of the gradient; with fp16 half of that. Writes
bench-results/dp_hosts.md and .json.

    python benchmarks/bench_dp_hosts.py [--rate 500mbit] [--rounds N] [--steps N] [--layouts 2x1,3x1,2x2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))
from _timing import add_timing_args, timed_rounds, timing_argv  # noqa: E402

RATES = {"200mbit": 200e6, "500mbit": 500e6, "1gbit": 1e9, "2gbit": 2e9}


def shape(rate: str) -> list[str]:
    """The tc qdisc arguments that shape a host's eth0 to ``rate``."""
    return ["tbf", "rate", rate, "burst", "256kbit", "latency", "50ms"]

LAYOUTS = {"2x1": (2, 1), "3x1": (3, 1), "2x2": (2, 2)}
MODES = ("ddp", "dp", "dp-after", "dp-mpi", "fp16", "compute")
HVD_MODES = ("dp", "hvd")  # timed in a second phase, once the Horovod adapter's engine runs
OUT_DIR = REPO / "bench-results"
BIN = Path(sys.executable).parent


def bound_s(nbytes: int, hosts: int, rate_bps: float, fp16: bool = False) -> float:
    """Seconds the link needs for one step's gradient: a ring over ``hosts`` hosts sends
    2(n-1)/n of it from each host (shared memory inside a host costs the link nothing)."""
    sent = 2 * (hosts - 1) / hosts * nbytes * (0.5 if fp16 else 1.0)
    return sent * 8 / rate_bps


# ----------------------------------------------------------------------------- in the job
def _runners(rank: int, modes):
    import torch

    import dtrun.collectives.dp as dp
    import dtrun.collectives.horovod.torch as hvd
    from bench_ddp import batch, fresh_model, make_step

    def distributed(make):  # the optimizer wrapped by ``make(opt, named_parameters)``
        def build(model, opt):
            return model, make(opt, model.named_parameters())
        return build

    def through_mpi(o, n):
        os.environ["DTRUN_DP_TRANSPORT"] = "mpi"  # read when the optimizer is made
        try:
            return dp.DistributedOptimizer(o, named_parameters=n)
        finally:
            del os.environ["DTRUN_DP_TRANSPORT"]

    wrap = {
        "ddp": lambda model, opt: (torch.nn.parallel.DistributedDataParallel(model), opt),
        "dp": distributed(lambda o, n: dp.DistributedOptimizer(o, named_parameters=n)),
        "dp-after": distributed(lambda o, n: dp.DistributedOptimizer(o, named_parameters=n, overlap=False)),
        "dp-mpi": distributed(through_mpi),
        "fp16": distributed(lambda o, n: dp.DistributedOptimizer(o, named_parameters=n,
                                                                 compression=dp.Compression.fp16)),
        "hvd": distributed(lambda o, n: hvd.DistributedOptimizer(o, named_parameters=n)),
        "compute": lambda model, opt: (model, opt),  # forward, backward, step: no exchange
    }
    x, y = batch(rank)
    return {mode: make_step(*wrap[mode](*fresh_model()), x, y) for mode in modes}


LEADER_RING = "ring allreduce, one rank per host"
LEADER_EXCHANGE = "bare exchange of the bound's bytes (MPI_Sendrecv), one rank per host"


def _bare_allreduce(nbytes: int, args, cpu=None) -> dict:
    """Median seconds of bare whole-gradient transfers (see the module's docstring)."""
    import numpy as np
    from mpi4py import MPI

    import dtrun.collectives.dp as dp

    from dtrun.collectives.streamring import StreamRing

    import torch
    import torch.distributed as dist

    comm = dp.init().comm
    buf = np.ones(nbytes // 4, np.float32)
    out = np.empty_like(buf)
    tbuf = torch.from_numpy(buf)
    calls = {"raw MPI allreduce, in place": lambda: comm.mpi.Allreduce(MPI.IN_PLACE, buf),
             "raw MPI allreduce, out of place": lambda: comm.mpi.Allreduce(buf, out),
             "gloo allreduce (torch.distributed), in place": lambda: dist.all_reduce(tbuf),
             "runtime allreduce, in place": lambda: comm.allreduce(buf, inplace=True),
             "runtime allreduce, out of place": lambda: comm.allreduce(buf, out=out)}
    leaders = comm.mpi.Split(0 if comm.local_rank == 0 else MPI.UNDEFINED, comm.rank)
    idle = lambda: None  # noqa: E731 - the other ranks of a host wait for the leader
    if leaders == MPI.COMM_NULL:
        calls.update({LEADER_RING: idle, LEADER_EXCHANGE: idle})
    else:
        ring = StreamRing(leaders.Dup())
        n, r = leaders.Get_size(), leaders.Get_rank()
        part = np.ones(buf.size * 2 * (n - 1) // n, np.float32)  # the bytes the bound counts
        recv = np.empty_like(part)
        calls[LEADER_RING] = lambda: ring.wait(ring.submit(buf))
        calls[LEADER_EXCHANGE] = lambda: leaders.Sendrecv(part, dest=(r + 1) % n, recvbuf=recv,
                                                          source=(r - 1) % n)
    if cpu is not None:
        calls = {k: cpu.wrap(k, call) for k, call in calls.items()}
    rounds = timed_rounds(calls, args, lambda v: dp.allreduce_metric(v, op="max"))
    return {k: statistics.median(v) for k, v in rounds.items()}


class CpuShare:
    """Where this machine's CPU time went while each variant ran: rank 0 reads /proc/stat
    (the namespace hosts share this machine's CPUs and kernel) around each of its steps.
    ``busy`` is the share not idle; ``kernel`` the share in system, irq and softirq time,
    which here is mostly the simulated links' packet work (veth, tbf, TCP)."""

    def __init__(self) -> None:
        self.ticks: dict[str, list[int]] = {}

    @staticmethod
    def _stat() -> list[int]:
        with open("/proc/stat") as f:
            return [int(t) for t in f.readline().split()[1:9]]

    def wrap(self, mode: str, step):
        def run():
            a = self._stat()
            step()
            b = self._stat()
            acc = self.ticks.setdefault(mode, [0] * 8)
            for i in range(8):
                acc[i] += b[i] - a[i]
        return run

    def shares(self) -> dict[str, dict[str, float]]:
        out = {}
        for mode, t in self.ticks.items():  # user nice system idle iowait irq softirq steal
            total = sum(t) or 1
            out[mode] = {"busy": 1 - (t[3] + t[4]) / total, "kernel": (t[2] + t[5] + t[6]) / total}
        return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    import dtrun.collectives.dp as dp
    import dtrun.collectives.horovod.torch as hvd

    torch.set_num_threads(1)
    ctx = dp.init()
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    cpu = CpuShare()
    metric = lambda v: dp.allreduce_metric(v, op="max")  # noqa: E731
    from bench_ddp import build_model

    nbytes = 4 * sum(p.numel() for p in build_model().parameters())
    # The bare transfers and the main variants run before the Horovod adapter's engine
    # starts: its background thread enters MPI every few ms, which no other variant pays.
    bare = _bare_allreduce(nbytes, args, cpu if ctx.rank == 0 else None)
    runners = _runners(ctx.rank, MODES)
    if ctx.rank == 0:
        runners = {m: cpu.wrap(m, step) for m, step in runners.items()}
    rounds = timed_rounds(runners, args, metric)
    hvd.init()
    paired = _runners(ctx.rank, HVD_MODES)
    hvd_rounds = timed_rounds(paired, args, metric)
    if ctx.rank == 0:
        print("BENCH " + json.dumps({"size": ctx.size, "grad_bytes": nbytes,
                                      "median_s": {m: statistics.median(v) for m, v in rounds.items()},
                                      "hvd_median_s": {m: statistics.median(v) for m, v in hvd_rounds.items()},
                                      "rounds": rounds, "hvd_rounds": hvd_rounds, "bare_s": bare,
                                      "cpu": cpu.shares()}),
              flush=True)
    import gc

    runners.clear()
    paired.clear()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


# ----------------------------------------------------------------------------- the driver
def run_layout(cluster, hosts: int, per_host: int, args) -> dict:
    spec = ",".join(f"{h.name}:{per_host}" for h in cluster.hosts[:hosts])
    cmd = [str(BIN / "dtrun"), "--no-tag-output", "--ssh-config", str(cluster.ssh_config), "-H", spec,
           sys.executable, str(Path(__file__).resolve()), "--worker", *timing_argv(args)]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO, env=env,
                          stdin=subprocess.DEVNULL)
    line = next((ln for ln in proc.stdout.splitlines() if "BENCH {" in ln), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"bench_dp_hosts: {' '.join(cmd)} failed ({proc.returncode}):\n"
                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    doc = json.loads(line[line.index("{"):])
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    return doc


def report(results: dict, rate: str) -> list[str]:
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    lines = [f"# Data-parallel training across shaped hosts ({rate})", "",
             "Each host's eth0: `tc qdisc replace dev eth0 root " + " ".join(shape(rate)) + "`. MLP "
             "256-1024x4-10, batch 32 per rank, SGD with momentum, 1 thread per rank; median "
             "step over alternating rounds in one job. Bound: the bytes each host sends per "
             f"step (ring: 2(n-1)/n of the gradient; fp16: half) at {rate}.", ""]
    for name, doc in results.items():
        hosts = LAYOUTS[name][0]
        med, nbytes = doc["median_s"], doc["grad_bytes"]
        b, bh = bound_s(nbytes, hosts, RATES[rate]), bound_s(nbytes, hosts, RATES[rate], fp16=True)
        lines += [f"## {hosts} hosts x {LAYOUTS[name][1]} rank(s): link bound {ms(b)} ms "
                  f"({ms(bh)} ms with fp16)", "",
                  "| variant | step (ms) | / bound | DDP / it | CPU busy (kernel) |",
                  "|---|---:|---:|---:|---:|"]
        cpu = doc.get("cpu", {})
        for m in MODES:
            c = cpu.get(m)
            share = f"{c['busy'] * 100:.0f} % ({c['kernel'] * 100:.0f} %)" if c else ""
            lines.append(f"| {m} | {ms(med[m])} | {med[m] / (bh if m == 'fp16' else b):.2f} | "
                         f"{med['ddp'] / med[m]:.2f} | {share} |")
        hv = doc["hvd_median_s"]
        lines.append(f"| hvd (Horovod adapter; beside it, dp took {ms(hv['dp'])}) | {ms(hv['hvd'])} | "
                     f"{hv['hvd'] / b:.2f} | hvd / dp {hv['hvd'] / hv['dp']:.3f} | |")
        for k, v in doc["bare_s"].items():
            c = cpu.get(k)
            share = f"{c['busy'] * 100:.0f} % ({c['kernel'] * 100:.0f} %)" if c else ""
            lines.append(f"| {k} ({nbytes / 1e6:.1f} MB) | {ms(v)} | {v / b:.2f} | | {share} |")
        lines.append("")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layouts", default="2x1,3x1,2x2")
    ap.add_argument("--rate", default="500mbit", choices=sorted(RATES),
                    help="each host's link (default 500mbit: the link sets the pace on 2 hosts; "
                         "200mbit: on 3 hosts too; 2gbit: this machine's cores do)")
    add_timing_args(ap, rounds=6)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if os.geteuid() != 0:
        print("bench_dp_hosts: needs root (namespace hosts and tc); skipped")
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        print("bench_dp_hosts: PyTorch is not installed; skipped")
        return 0
    from tests.nscluster import Cluster, ClusterUnavailable

    layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        sys.exit(f"bench_dp_hosts: --layouts {','.join(bad)}: choose from {','.join(LAYOUTS)}")
    results = {}
    try:
        with Cluster(max(LAYOUTS[x][0] for x in layouts)) as cluster:
            for h in cluster.hosts:
                cluster.exec(h, ["tc", "qdisc", "replace", "dev", "eth0", "root", *shape(args.rate)],
                             check=True)
            for name in layouts:
                results[name] = run_layout(cluster, *LAYOUTS[name], args)
                print(f"{name}: {results[name]['wall_s']} s", flush=True)
    except ClusterUnavailable as e:
        print(f"bench_dp_hosts: no namespace cluster here ({e}); skipped")
        return 0
    lines = report(results, args.rate)
    OUT_DIR.mkdir(exist_ok=True)
    stem = "dp_hosts" if args.rate == "500mbit" else f"dp_hosts_{args.rate}"
    (OUT_DIR / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (OUT_DIR / f"{stem}.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
