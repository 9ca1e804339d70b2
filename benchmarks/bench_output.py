"""How much of a remote rank's large output reaches the reader, with and without dtrun.

One namespace host (tests/nscluster/) runs one rank that writes LINES lines of 109
bytes (about 22 MB at the default) and exits. Its output is read by a fast reader
(``wc -c``-like) and by a slow one (about 3 MB/s), through bare mpirun (Open MPI 5, the
flags dtrun builds, no rank wrapper), through dtrun, and through ``dtrun --log-dir``
(counted in the rank's log file). Reports the share of bytes received per run.

Then one line of LONG_LINE_MB (10 by default; 0 skips it) without a newline, from the remote
rank and from one on this machine, through bare mpirun and through dtrun: the bytes received,
the wall time, and the CPU time of everything started on this machine (dtrun's reading of
such a line must add little to mpirun's own).
Writes bench-results/output.md and output.json. Needs root (namespaces).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests import nscluster  # noqa: E402
from tests.dtrun_helpers import BIN, DTRUN, user_env  # noqa: E402

LINES = int(os.environ.get("BENCH_OUTPUT_LINES", "200000"))
RUNS = int(os.environ.get("BENCH_OUTPUT_RUNS", "3"))
LINE_BYTES = 109
LONG_LINE_MB = int(os.environ.get("BENCH_OUTPUT_LONG_LINE_MB", "10"))
# One line without a newline; it starts like the rank wrapper's end-of-output marker and has a
# "d" (the marker's first letter) every few bytes, the worst case for finding markers.
LONG_WRITER = ("import sys\nn = {n}\nunit = b'dtrun-rank-eof: rank=0 abcd efgh dddd '\n"
               "sys.stdout.buffer.write((unit * (n // len(unit) + 1))[:n])\nsys.stdout.flush()\n")
WRITER = ("import sys\nw = sys.stdout.buffer.write\n"
          f"for i in range({LINES}):\n    w(b'%08d ' % i + b'x' * 99 + b'\\n')\nsys.stdout.flush()\n")
# Reads stdin and prints the byte count; with an argument, sleeps that long per 64 KiB.
READER = ("import sys, time\nd = float(sys.argv[1])\nn = 0\nwhile True:\n    b = sys.stdin.buffer.read(65536)\n"
          "    if not b: break\n    n += len(b)\n    time.sleep(d)\nprint(n)\n")


def bare_argv(cluster, host, writer: str = WRITER) -> list[str]:
    from dtrun.launcher.command import build_command
    from dtrun.launcher.hosts import HostOptions
    from dtrun.launcher.launch import LaunchOptions, prepare

    opts = LaunchOptions(program=(str(BIN / "python"), "-c", writer),
                         hosts=HostOptions(host_list=f"{host}:1", ssh_config=str(cluster.ssh_config)),
                         rank_wrapper=False, tag_output=False)
    prepared = prepare(opts, environ=user_env())
    flavor, spec = prepared.flavor, prepared.spec
    return build_command(spec, flavor)


def received(argv, delay: float) -> int:
    writer = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=user_env(), cwd=REPO,
                              stdin=subprocess.DEVNULL)
    reader = subprocess.run([sys.executable, "-c", READER, str(delay)], stdin=writer.stdout, capture_output=True,
                            text=True, timeout=600)
    writer.stdout.close()
    writer.wait(timeout=60)
    return int(reader.stdout.strip() or 0)


def timed(argv) -> tuple[int, float, float]:
    """Bytes on stdout, wall seconds, and CPU seconds of the command and all it started here."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=user_env(), cwd=REPO,
                            stdin=subprocess.DEVNULL)
    n = 0
    while True:
        b = proc.stdout.read(1 << 16)
        if not b:
            break
        n += len(b)
    proc.wait(timeout=600)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return n, wall, cpu


def long_line(cluster, host) -> dict:
    """One LONG_LINE_MB line without a newline through bare mpirun and through dtrun, from a
    rank on the remote host and from one on this machine."""
    writer = LONG_WRITER.format(n=LONG_LINE_MB << 20)
    out = {}
    for where, on in (("remote rank", host), ("rank on this machine", "localhost")):
        dt = [DTRUN, "--ssh-config", str(cluster.ssh_config), "-H", f"{on}:1", "--no-tag-output",
              str(BIN / "python"), "-c", writer]
        for label, argv in (("bare mpirun", bare_argv(cluster, on, writer)), ("dtrun", dt)):
            n, wall, cpu = timed(argv)
            out[f"{label}, {where}"] = {"bytes": n, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
    return out


def main() -> int:
    out_dir = REPO / "bench-results"
    out_dir.mkdir(exist_ok=True)
    expected = LINES * LINE_BYTES
    results: dict = {"lines": LINES, "bytes": expected, "runs": {}}
    with nscluster.Cluster(1) as cluster:
        host = cluster.hosts[0].name
        bare = bare_argv(cluster, host)
        dt = [DTRUN, "--ssh-config", str(cluster.ssh_config), "-H", f"{host}:1", "--no-tag-output",
              str(BIN / "python"), "-c", WRITER]
        for reader, delay in (("fast reader", 0.0), ("slow reader (~3 MB/s)", 0.02)):
            for label, argv in (("bare mpirun", bare), ("dtrun", dt)):
                got = [received(argv, delay) for _ in range(RUNS)]
                results["runs"][f"{label}, {reader}"] = [round(100 * g / expected, 1) for g in got]
        logged = []
        for i in range(RUNS):
            log_dir = Path(f"/tmp/dtrun-bench-output-{os.getpid()}-{i}")
            subprocess.run([DTRUN, "--ssh-config", str(cluster.ssh_config), "-H", f"{host}:1", "--log-dir",
                            str(log_dir), str(BIN / "python"), "-c", WRITER], env=user_env(), cwd=REPO,
                           capture_output=True, timeout=300)
            path = log_dir / "latest" / "rank.0.log"
            logged.append(round(100 * (path.stat().st_size if path.exists() else 0) / expected, 1))
            import shutil

            shutil.rmtree(log_dir, ignore_errors=True)
        results["runs"]["dtrun --log-dir (rank.0.log)"] = logged
        if LONG_LINE_MB > 0:
            results["long_line"] = long_line(cluster, host)
    lines = [f"# Output of one remote rank ({LINES} lines, {expected / 1e6:.1f} MB): share received, per run", "",
             "| path | received (% of bytes), per run |", "|---|---|"]
    for label, shares in results["runs"].items():
        lines.append(f"| {label} | {' / '.join(f'{s:g}%' for s in shares)} |")
    if "long_line" in results:
        lines += ["", f"# One line of {LONG_LINE_MB} MiB ({LONG_LINE_MB << 20} bytes) without a newline", "",
                  "| path | bytes received | wall s | CPU s, launching side |", "|---|---|---|---|"]
        for label, r in results["long_line"].items():
            lines.append(f"| {label} | {r['bytes']} | {r['wall_s']:g} | {r['cpu_s']:g} |")
    text = "\n".join(lines) + "\n"
    (out_dir / "output.md").write_text(text)
    (out_dir / "output.json").write_text(json.dumps(results, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
