"""Smoke test: every collective, several dtypes and sizes, checked on every rank.

Run under a launcher, e.g. ``dtrun -np 4 python -m dtrun.collectives.smoke`` (``dtrun
smoke`` calls ``main``). Inputs are small integers, so every expected value is exact
in every dtype (bfloat16 holds integers up to 256 exactly) and results are compared
bit for bit. Rank 0 gathers what each rank saw and prints one table.

A collective that does not finish within ``--timeout`` seconds is reported as a hang
("HANG: allreduce float32 n=1023 did not complete within 30 s on rank 1 (host)") by a
watchdog thread, which then aborts the job with exit code 3 instead of waiting
forever.

Exit codes: 0 all values right on all ranks; 1 a wrong value somewhere; 2 bad usage;
3 a hang.

Test-only hooks (used by the test suite to prove the checks can fail; never set them
otherwise): ``DTRUN_SMOKE_INJECT_ERROR=op:rank`` corrupts one value of ``op`` on
``rank``; ``DTRUN_SMOKE_INJECT_HANG=op:rank`` makes ``rank`` never enter ``op``.

This module holds the options, the table and ``main``; the checks are in ``smoke_checks``.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from enum import IntEnum

OPS = ("sendrecv", "broadcast", "scatter", "gather", "reduce", "allreduce", "allgather",
       "allgatherv", "reduce_scatter", "alltoall", "iallreduce", "grouped")
DTYPES = ("float32", "float64", "int32", "int64", "float16", "bfloat16")
SIZES = (0, 1, 1023, 100003)  # empty, one element, odd, big enough for the shm path


class SmokeExit(IntEnum):
    OK = 0
    WRONG = 1
    USAGE = 2
    HANG = 3


def build_parser() -> argparse.ArgumentParser:
    """The smoke test's options (``dtrun smoke --help`` shows them, and routes them here)."""
    p = argparse.ArgumentParser(
        prog="python -m dtrun.collectives.smoke",
        description="Check every collective on every rank: each operation, dtype and size is run with "
                    "exact small-integer inputs and compared bit for bit; rank 0 prints one table. "
                    "A collective that does not finish within --timeout is reported as a hang. "
                    "Exit codes: 0 all right, 1 a wrong value, 2 bad usage, 3 a hang.")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds one collective may take before it counts as a hang")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ops", default="all",
                   help=f"comma-separated subset of: {', '.join(OPS)}")
    p.add_argument("--dtypes", default="all", help=f"subset of: {', '.join(DTYPES)}")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)),
                   help="element counts per rank, comma-separated")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.ops = list(OPS) if args.ops == "all" else [o.strip() for o in args.ops.split(",")]
    unknown = [o for o in args.ops if o not in OPS]
    if unknown:
        p.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(OPS)}")
    args.dtypes = list(DTYPES) if args.dtypes == "all" else args.dtypes.split(",")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        p.error(f"unknown dtype(s) {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes must be integers, got {args.sizes!r}")
    return args


def render(rows: list[dict], ops: list[str], as_json: bool, ok: bool) -> str:
    """The one table (or JSON document) rank 0 prints."""
    if as_json:
        return json.dumps({"ok": ok, "ops": ops, "ranks": rows}, indent=2)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text fallback
        head = ["rank", "host", "local", "device"] + ops
        lines = ["  ".join(head)]
        for r in rows:
            lines.append("  ".join([str(r["rank"]), r["host"], str(r["local_rank"]), r["device"]]
                                   + ["ok" if r["results"][o]["ok"] else "FAIL" for o in ops]))
        return "\n".join(lines)
    table = Table(title="collectives smoke test", show_lines=False)
    for col in ("rank", "host", "local", "device"):
        table.add_column(col)
    for op in ops:
        table.add_column(op, justify="center")
    for r in rows:
        table.add_row(str(r["rank"]), r["host"], str(r["local_rank"]), r["device"],
                      *["[green]ok[/]" if r["results"][o]["ok"] else "[red bold]FAIL[/]"
                        for o in ops])
    buf = io.StringIO()
    Console(file=buf, width=max(120, 30 + 12 * len(ops)), force_terminal=False,
            color_system=None).print(table)
    return buf.getvalue().rstrip()


def main(argv: list[str] | None = None) -> int:
    """Run the smoke test on all ranks; return the exit code (same on every rank)."""
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return int(SmokeExit.USAGE) if e.code else 0
    from . import smoke_checks  # lazy: initialises MPI; the dtrun CLI imports smoke for its parser
    comm, rows, ok = smoke_checks.run(args, int(SmokeExit.HANG))
    if ok is None:
        return int(SmokeExit.USAGE)
    if comm.rank == 0:
        print(render(rows, args.ops, args.json, ok), flush=True)
        if not args.json:
            _print_failures(rows, args, ok, comm.size)
    # A non-zero exit makes mpirun kill the other ranks: wait until rank 0 has printed.
    comm.barrier()
    return int(SmokeExit.OK if ok else SmokeExit.WRONG)


def _print_failures(rows: list[dict], args, ok: bool, nranks: int) -> None:
    """The lines under the table: each rank's first failure per op, then the summary."""
    for r in rows:
        for op, res in r["results"].items():
            if not res["ok"]:
                print(f"FAIL rank {r['rank']} ({r['host']}): {res['detail']}",
                      flush=True)
    checks = sum(res["checks"] for r in rows for res in r["results"].values())
    print(f"{'PASS' if ok else 'FAIL'}: {len(args.ops)} operations x "
          f"{len(args.dtypes)} dtypes x sizes {args.sizes}, {checks} checks on "
          f"{nranks} ranks", flush=True)


if __name__ == "__main__":
    sys.exit(main())
