"""dtrun doctor's wall time against the number of hosts, next to plain parallel ssh.

For 1, 4, 8 and 16 namespace hosts (tests/nscluster/; needs root), in one run:
``dtrun doctor --no-e2e`` (every check but the end-to-end job) and ``ssh -F cfg HOST
true`` to all hosts at once, alternating, BENCH_REPS times each; medians. Every
simulated host shares this machine's cores, so the SSH handshakes themselves are
the floor. Also counts the TCP connections doctor opens to each host's port 22
(iptables counters inside each host) and, on 4 hosts, what one black-holed host
adds with --timeout 2. Writes bench-results/doctor.md and doctor.json.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.dtrun_helpers import BIN, DTRUN, user_env as env  # noqa: E402  (the same environment the tests use)
SIZES = tuple(int(n) for n in os.environ.get("BENCH_HOSTS", "1,4,8,16").split(","))
REPS = int(os.environ.get("BENCH_REPS", "3"))
TARGET_RATIO = 1.5
TARGET_4_HOSTS_S = 5.0
DEAD_TIMEOUT_S = 2.0



def doctor_argv(cluster, *extra):
    return [DTRUN, "doctor", "--ssh-config", str(cluster.ssh_config), "--hostfile", str(cluster.hostfile),
            "--no-e2e", "--json", *extra]


def time_doctor(cluster, *extra, expect=0) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(doctor_argv(cluster, *extra), capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    dt = time.perf_counter() - t0
    if p.returncode != expect:
        raise SystemExit(f"doctor on {cluster.n} hosts exited {p.returncode}: {p.stderr[-500:]}{p.stdout[-2000:]}")
    return dt


def time_plain_ssh(cluster) -> float:
    """`ssh -F cfg HOST true` to every host at once; the wall time until the last returns."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["ssh", "-F", str(cluster.ssh_config), h.name, "true"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for h in cluster.hosts]
    for p in procs:
        _, err = p.communicate(timeout=120)
        if p.returncode != 0:
            raise SystemExit(f"ssh failed: {err.decode()[-300:]}")
    return time.perf_counter() - t0


def ipt(cluster, host, *args):
    return subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-w", "5", *args],
                          capture_output=True, text=True, check=True).stdout


def ssh_connections_per_host(cluster) -> list[int]:
    """New TCP connections to port 22 of each host during one doctor run (an iptables counting rule)."""
    rule = ["INPUT", "-p", "tcp", "--dport", "22", "--syn", "-m", "comment", "--comment", "dtrun-bench-count"]
    for h in cluster.hosts:
        ipt(cluster, h, "-I", *rule)
    try:
        time_doctor(cluster)
        counts = []
        for h in cluster.hosts:
            line = next(l for l in ipt(cluster, h, "-L", "INPUT", "-v", "-x", "-n").splitlines()
                        if "dtrun-bench-count" in l)
            counts.append(int(line.split()[0]))
        return counts
    finally:
        for h in cluster.hosts:
            ipt(cluster, h, "-D", *rule)


def measure(n: int) -> dict:
    from tests.nscluster import Cluster

    with Cluster(n) as cluster:
        time_doctor(cluster), time_plain_ssh(cluster)  # warm: page cache, flavor cache
        doctor, plain = [], []
        for i in range(REPS):
            if i % 2 == 0:
                doctor.append(time_doctor(cluster))
                plain.append(time_plain_ssh(cluster))
            else:
                plain.append(time_plain_ssh(cluster))
                doctor.append(time_doctor(cluster))
        row = {"hosts": n, "doctor_s": statistics.median(doctor), "plain_ssh_s": statistics.median(plain),
               "doctor_runs": doctor, "plain_ssh_runs": plain, "ssh_connections": ssh_connections_per_host(cluster)}
        row["ratio"] = row["doctor_s"] / row["plain_ssh_s"]
        if n == 4:
            healthy = statistics.median(time_doctor(cluster, "--timeout", str(DEAD_TIMEOUT_S)) for _ in range(REPS))
            cluster.add_fault(n - 1, "blackhole")
            dead = statistics.median(time_doctor(cluster, "--timeout", str(DEAD_TIMEOUT_S), expect=1)
                                     for _ in range(REPS))
            row["dead_host"] = {"timeout_s": DEAD_TIMEOUT_S, "healthy_s": healthy, "one_blackholed_s": dead,
                                "added_s": dead - healthy}
    return row


def main() -> int:
    from tests.nscluster import cluster_unavailable_reason

    reason = cluster_unavailable_reason()
    if reason:
        print(f"bench_doctor: skipped, no namespace cluster here: {reason}")
        return 0
    out_dir = REPO / "bench-results"
    out_dir.mkdir(exist_ok=True)
    rows = [measure(n) for n in SIZES]
    four = next((r for r in rows if r["hosts"] == 4), None)
    targets = {
        "one_ssh_connection_per_host": all(c == 1 for r in rows for c in r["ssh_connections"]),
        f"doctor_at_most_{TARGET_RATIO}x_plain_ssh": all(r["ratio"] <= TARGET_RATIO for r in rows),
    }
    if four:
        targets[f"healthy_4_hosts_under_{TARGET_4_HOSTS_S:g}s"] = four["doctor_s"] < TARGET_4_HOSTS_S
        targets["dead_host_adds_at_most_its_timeout"] = four["dead_host"]["added_s"] <= DEAD_TIMEOUT_S
    res = {"reps": REPS, "cores": os.cpu_count(), "rows": rows, "targets": targets}
    (out_dir / "doctor.json").write_text(json.dumps(res, indent=2))
    ok = lambda b: "✓" if b else "✗"
    md = ["| hosts | dtrun doctor --no-e2e | ssh host true, all in parallel | doctor / ssh | ssh connections per host |",
          "|---|---|---|---|---|"]
    for r in rows:
        conns = sorted(set(r["ssh_connections"]))
        md.append(f"| {r['hosts']} | {r['doctor_s']:.2f} s | {r['plain_ssh_s']:.2f} s | "
                  f"{r['ratio']:.2f}× {ok(r['ratio'] <= TARGET_RATIO)} | {', '.join(map(str, conns))} |")
    if four:
        d = four["dead_host"]
        md += ["", f"One black-holed host among 4 (--timeout {d['timeout_s']:g}): {d['one_blackholed_s']:.2f} s "
                   f"against {d['healthy_s']:.2f} s healthy, +{d['added_s']:.2f} s "
                   f"{ok(d['added_s'] <= DEAD_TIMEOUT_S)} (target: at most the timeout)."]
    md += ["", f"Medians of {REPS} alternating runs on {os.cpu_count()} cores shared by every simulated host.",
           "Targets: " + "; ".join(f"{k} {ok(v)}" for k, v in targets.items())]
    (out_dir / "doctor.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0  # like bench_launch: the targets are reported, not enforced (timings on a shared machine vary)


if __name__ == "__main__":
    sys.exit(main())
