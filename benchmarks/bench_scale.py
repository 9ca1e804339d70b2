"""dtrun at 65 hosts on one machine (tests/nscluster/; needs root). ``make bench-scale``.

* the namespace cluster: ``up`` and ``down`` of 65 hosts (BENCH_REPS times, medians);
* a 65-rank mpi4py allreduce, 1 rank per host, through dtrun and through bare mpirun
  (the same Open MPI 5, only the ssh config and root flags), alternating; how many daemons
  were started by another host's ssh (tree spawn); then the same through Debian's Open
  MPI 4.1 (orted tree), with what happened;
* ``dtrun doctor --no-e2e`` and the launch preflight (``dtrun --dry-run`` less
  ``--dry-run --no-preflight``) on the first 1/4/16/64 hosts, next to ``ssh HOST true`` to
  those hosts all at once; doctor's all-pairs firewall round at 64 hosts, its peak open
  file descriptors and its memory (max RSS);
* ``doctor --links``: on 4 hosts with one tbf'd to 50 Mb/s (what it names), and on 64.

Commands run with bytecode caching on, as users run them. Writes bench-results/scale.md and
scale.json. Timings on a shared 2-core machine are noisy: read the medians.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.dtrun_helpers import BIN, DTRUN, user_env  # noqa: E402

HOSTS = int(os.environ.get("BENCH_SCALE_HOSTS", "65"))
SIZES = tuple(int(n) for n in os.environ.get("BENCH_SCALE_SIZES", "1,4,16,64").split(","))
REPS = int(os.environ.get("BENCH_REPS", "3"))
OMPI4 = "/usr/bin/mpirun.openmpi"
LIBMPI4 = "/usr/lib/x86_64-linux-gnu/libmpi.so.40"
PROGRAM = r"""
import os, socket
from mpi4py import MPI
c = MPI.COMM_WORLD
rows = c.gather((socket.gethostname(), os.environ.get("SSH_CLIENT", "-").split()[0]), root=0)
total = c.allreduce(c.rank)
if c.rank == 0:
    print("SOURCES " + " ".join(src for _, src in rows))
    print(f"allreduce over {c.size} ranks: {total}", flush=True)
"""


def env(**extra):
    e = user_env(**extra)
    e.pop("PYTHONDONTWRITEBYTECODE", None)
    return e


def run(argv, timeout=600, **kw):
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL,
                       env=kw.pop("env", None) or env(), **kw)
    return p, time.perf_counter() - t0


def plain_ssh(cluster, hosts) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["ssh", "-F", str(cluster.ssh_config), h, "true"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for h in hosts]
    for p in procs:
        _, err = p.communicate(timeout=120)
        if p.returncode != 0:
            raise SystemExit(f"ssh failed: {err.decode()[-300:]}")
    return time.perf_counter() - t0


def updown() -> dict:
    from tests.nscluster import Cluster

    ups, downs = [], []
    for _ in range(REPS):
        c = Cluster(HOSTS)
        t0 = time.perf_counter()
        c.up()
        ups.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        c.down()
        downs.append(time.perf_counter() - t0)
    return {"hosts": HOSTS, "up_s": statistics.median(ups), "down_s": statistics.median(downs),
            "up_runs": ups, "down_runs": downs}


def tree_hops(stdout: str, gateway: str) -> int:
    line = next((l for l in stdout.splitlines() if "SOURCES " in l), "")
    return sum(1 for src in line.split("SOURCES ", 1)[-1].split() if src != gateway)


def launches(cluster) -> dict:
    names = [h.name for h in cluster.hosts]
    program = ["python", "-c", PROGRAM]
    mpirun = str(BIN / "mpirun")
    bare = [mpirun, "-np", str(len(names)), "-H", ",".join(f"{n}:1" for n in names), "--allow-run-as-root",
            "--prtemca", "plm_ssh_args", f"-F {cluster.ssh_config}", str(BIN / "python"), "-c", PROGRAM]
    dt = [DTRUN, "--ssh-config", str(cluster.ssh_config), "--hostfile", str(cluster.hostfile), *program]
    times = {"dtrun": [], "bare_mpirun": []}
    hops = None
    for i in range(max(2, REPS - 1)):
        order = (("dtrun", dt), ("bare_mpirun", bare)) if i % 2 == 0 else (("bare_mpirun", bare), ("dtrun", dt))
        for label, argv in order:
            p, t = run(argv)
            if p.returncode != 0 or f"allreduce over {len(names)} ranks" not in p.stdout:
                raise SystemExit(f"{label} on {len(names)} hosts exited {p.returncode}: {p.stderr[-1500:]}")
            times[label].append(t)
            if label == "dtrun":
                hops = tree_hops(p.stdout, cluster.gateway)
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update(runs=times, daemons_started_by_another_host=hops)
    # Open MPI 4.1 (Debian), the same program through mpi4py bound to its libmpi.
    p, t = run([DTRUN, "--mpirun", OMPI4, "--ssh-config", str(cluster.ssh_config), "--hostfile",
                str(cluster.hostfile), "-x", f"MPI4PY_LIBMPI={LIBMPI4}", "--timeout", "300", *program], timeout=400)
    out["ompi4"] = {"exit": p.returncode, "seconds": t, "ok": f"allreduce over {len(names)} ranks" in p.stdout,
                    "daemons_started_by_another_host": tree_hops(p.stdout, cluster.gateway) if p.returncode == 0 else None,
                    "stderr_tail": p.stderr[-1500:]}
    return out


def peak_fds(proc: subprocess.Popen, box: list) -> None:
    """Open descriptors of doctor itself (the child of /usr/bin/time), sampled every 20 ms."""
    while proc.poll() is None:
        try:
            kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            box.append(max((len(os.listdir(f"/proc/{k}/fd")) for k in kids), default=0))
        except OSError:
            pass
        time.sleep(0.02)


def doctor_once(cluster, hosts, *extra) -> tuple[dict, float, int, int]:
    argv = ["/usr/bin/time", "-f", "MAXRSS %M", DTRUN, "doctor", "--ssh-config", str(cluster.ssh_config), "-H",
            ",".join(hosts), "--no-e2e", "--json", *extra]
    fds: list = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env(),
                            stdin=subprocess.DEVNULL)
    sampler = threading.Thread(target=peak_fds, args=(proc, fds), daemon=True)
    sampler.start()
    out, err = proc.communicate(timeout=600)
    dt = time.perf_counter() - t0
    sampler.join(1)
    rss = int(next((l.split()[1] for l in err.splitlines() if l.startswith("MAXRSS ")), "0"))
    try:
        rep = json.loads(out)
    except ValueError:
        raise SystemExit(f"doctor on {len(hosts)} hosts: {err[-1500:]}")
    return rep, dt, max(fds or [0]), rss


def doctor_and_preflight(cluster) -> list:
    rows = []
    names = [h.name for h in cluster.hosts]
    for n in SIZES:
        hosts = names[:n]
        dry = [DTRUN, "--dry-run", "--ssh-config", str(cluster.ssh_config), "-H", ",".join(f"{h}:1" for h in hosts),
               "true"]
        doctor_once(cluster, hosts), plain_ssh(cluster, hosts), run(dry)  # warm
        doc, ssh, pre, nopre = [], [], [], []
        rep = fds = rss = None
        for i in range(REPS):
            steps = ["doctor", "ssh", "pre"] if i % 2 == 0 else ["pre", "ssh", "doctor"]
            for s in steps:
                if s == "doctor":
                    rep, t, fds, rss = doctor_once(cluster, hosts)
                    if rep["exit_code"] != 0:
                        bad = [f for f in rep["findings"] if f["status"] == "fail"][:3]
                        raise SystemExit(f"doctor on {n} hosts failed: {bad}")
                    doc.append(t)
                elif s == "ssh":
                    ssh.append(plain_ssh(cluster, hosts))
                else:
                    p, t = run(dry)
                    assert p.returncode == 0, p.stderr[-1000:]
                    pre.append(t)
                    p, t = run(dry[:2] + ["--no-preflight"] + dry[2:])
                    nopre.append(t)
        row = {"hosts": n, "doctor_s": statistics.median(doc), "plain_ssh_s": statistics.median(ssh),
               "dry_run_s": statistics.median(pre), "dry_run_no_preflight_s": statistics.median(nopre),
               "doctor_runs": doc, "ssh_runs": ssh, "doctor_pairs_s": rep["timings"]["pairs"],
               "firewall_pairs": sum(len(v) for v in rep["firewall_pairs"].values()),
               "doctor_peak_fds": fds, "doctor_max_rss_kb": rss}
        row["ratio"] = row["doctor_s"] / row["plain_ssh_s"]
        row["preflight_s"] = row["dry_run_s"] - row["dry_run_no_preflight_s"]
        rows.append(row)
        print(f"  {n} hosts: doctor {row['doctor_s']:.2f} s, ssh {row['plain_ssh_s']:.2f} s, "
              f"ratio {row['ratio']:.2f}; dry run {row['dry_run_s']:.2f} s", flush=True)
    return rows


def links(cluster) -> dict:
    out = {}
    names = [h.name for h in cluster.hosts]
    rep, t, _, _ = doctor_once(cluster, names[:64], "--links")
    out["64_hosts"] = {"wall_s": t, "stage_s": rep["timings"]["links"], "pairs": rep["links"]["pairs"],
                       "median_mbps": rep["links"]["median_mbps"], "median_rtt_ms": rep["links"]["median_rtt_ms"],
                       "named": [f["detail"] for f in rep["findings"] if f["status"] == "warn"]}
    from tests.nscluster import Cluster

    with Cluster(4, faults={"h3": {"slow_link"}}) as small:
        rep, t, _, _ = doctor_once(small, [h.name for h in small.hosts], "--links")
        out["4_hosts_one_tbf"] = {"wall_s": t, "stage_s": rep["timings"]["links"], "pairs": rep["links"]["pairs"],
                                  "median_mbps": rep["links"]["median_mbps"], "slow_host": small.host("h3").name,
                                  "named": [f"{f['host']}: {f['detail']}" for f in rep["findings"]
                                            if f["status"] == "warn"]}
    return out


def main() -> int:
    from tests.nscluster import Cluster, cluster_unavailable_reason

    reason = cluster_unavailable_reason()
    if reason:
        print(f"bench_scale: skipped, no namespace cluster here: {reason}")
        return 0
    out_dir = REPO / "bench-results"
    out_dir.mkdir(exist_ok=True)
    res = {"cores": os.cpu_count(), "reps": REPS}
    print(f"cluster up/down, {HOSTS} hosts", flush=True)
    res["cluster"] = updown()
    with Cluster(HOSTS) as cluster:
        print("launches", flush=True)
        res["launch"] = launches(cluster)
        print("doctor and preflight", flush=True)
        res["doctor"] = doctor_and_preflight(cluster)
        print("links", flush=True)
        res["links"] = links(cluster)
    res["self_max_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (out_dir / "scale.json").write_text(json.dumps(res, indent=2))
    c, l = res["cluster"], res["launch"]
    md = [f"Namespace cluster of {c['hosts']} hosts: up {c['up_s']:.1f} s, down {c['down_s']:.1f} s "
          f"(medians of {REPS}).", "",
          f"{c['hosts']}-rank allreduce, 1 rank per host, Open MPI 5: dtrun {l['dtrun']:.1f} s, bare mpirun "
          f"{l['bare_mpirun']:.1f} s; {l['daemons_started_by_another_host']} daemon(s) started by another host's ssh "
          "(tree spawn).",
          f"Open MPI 4.1 (Debian, orted): exit {l['ompi4']['exit']} in {l['ompi4']['seconds']:.1f} s"
          + (f", {l['ompi4']['daemons_started_by_another_host']} daemon(s) started by another host"
             if l["ompi4"]["ok"] else f": {l['ompi4']['stderr_tail'].strip().splitlines()[-1:] }"), "",
          "| hosts | doctor --no-e2e | ssh host true, all at once | doctor / ssh | preflight (dry run with - without) "
          "| firewall pairs (time) | doctor peak fds | doctor max RSS |", "|---|---|---|---|---|---|---|---|"]
    for r in res["doctor"]:
        md.append(f"| {r['hosts']} | {r['doctor_s']:.2f} s | {r['plain_ssh_s']:.2f} s | {r['ratio']:.2f}× | "
                  f"{r['preflight_s']:.2f} s ({r['dry_run_s']:.2f} - {r['dry_run_no_preflight_s']:.2f}) | "
                  f"{r['firewall_pairs']} ({r['doctor_pairs_s']:.2f} s) | {r['doctor_peak_fds']} | "
                  f"{r['doctor_max_rss_kb'] / 1024:.0f} MB |")
    lk = res["links"]
    md += ["", f"doctor --links, 64 hosts: {lk['64_hosts']['pairs']} pairs (ring + sample) in "
               f"{lk['64_hosts']['stage_s']:.1f} s, median {lk['64_hosts']['median_mbps'] / 1000:.1f} Gb/s; named: "
               f"{lk['64_hosts']['named'] or 'nothing'}",
           f"doctor --links, 4 hosts, {lk['4_hosts_one_tbf']['slow_host']} under tbf 50mbit: "
           f"{lk['4_hosts_one_tbf']['pairs']} pairs in {lk['4_hosts_one_tbf']['stage_s']:.1f} s; named: "
           f"{lk['4_hosts_one_tbf']['named']}", "",
           f"Medians of {REPS} alternating runs on {os.cpu_count()} cores shared by every simulated host."]
    (out_dir / "scale.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
