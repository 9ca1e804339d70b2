"""``python -m tests.nscluster``: make, list and remove clusters that outlive the command.

    python -m tests.nscluster up 4 [--fault h2=firewall,bad_path] [--cluster-fault docker0]
    python -m tests.nscluster up 65 --deny-ssh h1:h65     # h1's key is not authorised on h65
    python -m tests.nscluster status
    python -m tests.nscluster down [PREFIX | --all]

State lives in ``STATE_DIR`` (``/tmp/dtrun-nscluster``), so ``down`` works from another process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import sys
import time
from typing import Sequence

from .cluster import Cluster
from .common import _PREFIX_RE, STATE_DIR, ClusterError
from .faults import HOST_FAULTS
from .namespaces import _netns_list
from .state import _origin, _state_files
from .teardown import down_all, down_prefix, leftovers


def _parse_fault_specs(specs: Sequence[str]) -> dict[str, set[str]]:
    """``["h2=firewall,dead", "h3=bad_path"]`` -> ``{"h2": {...}, "h3": {...}}``."""
    faults: dict[str, set[str]] = {}
    for spec in specs:
        host, sep, names = spec.partition("=")
        if not sep or not host or not names:
            raise ValueError(f"--fault {spec!r}: expected HOST=FAULT[,FAULT...], e.g. h2=firewall")
        key: int | str = int(host) if host.isdigit() else host
        faults.setdefault(key, set()).update(n.strip() for n in names.split(",") if n.strip())
    return faults


def _parse_pair(spec: str) -> tuple[int | str, int | str]:
    """``"h1:h65"`` -> ``("h1", "h65")`` (a host is h1.., a full name, or a 0-based index)."""
    src, sep, dst = spec.partition(":")
    if not sep or not src or not dst:
        raise ValueError(f"--deny-ssh {spec!r}: expected SRC:DST, e.g. h1:h65")
    return tuple(int(h) if h.isdigit() else h for h in (src, dst))


def _print_cluster(cluster: Cluster) -> None:
    print(f"cluster {cluster.prefix}: {cluster.n} hosts on {cluster.subnet} "
          f"(bridge {cluster.bridge}, gateway {cluster.gateway})")
    for host in cluster.hosts:
        faults = ",".join(sorted(cluster.faults_of(host))) or "healthy"
        denied = sorted(src for src, dst in cluster.denied_ssh if dst == host.name)
        if denied:
            faults += f"; refuses ssh from {', '.join(denied)}"
        print(f"  {host.name:<14} {host.addr:<15} {faults}")
    print(f"ssh config: {cluster.ssh_config}")
    print(f"hostfile:   {cluster.hostfile}")
    print(f"state:      {cluster.state_file}")
    print(f"try:        {shlex.join(cluster.ssh_argv(cluster.hosts[0]) + ['hostname'])}")


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.nscluster",
                                     description="Network-namespace test clusters for dtrun.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="create a cluster of N hosts and leave it running")
    p_up.add_argument("n", type=int)
    p_up.add_argument("--fault", "--faults", action="append", default=[], metavar="HOST=FAULT[,FAULT]",
                      help=f"per-host faults; HOST is h1.., a full name, or a 0-based index; "
                           f"FAULT one of {', '.join(sorted(HOST_FAULTS))}")
    p_up.add_argument("--cluster-fault", "--cluster-faults", action="append", default=[],
                      metavar="FAULT", help="fault for every host (docker0)")
    p_up.add_argument("--deny-ssh", action="append", default=[], metavar="SRC:DST",
                      help="refuse ssh from host SRC into host DST (the client key is not authorised there "
                           "from SRC), e.g. h1:h65")
    p_up.add_argument("--prefix", help="name prefix (default: random dtXXXX)")
    p_up.add_argument("--hold", action="store_true",
                      help="stay in the foreground; tear down on Ctrl-C / SIGTERM")
    p_up.add_argument("--json", action="store_true", help="print the state as JSON")
    p_down = sub.add_parser(
        "down", help="tear down clusters made by `up`: with no PREFIX every one on this machine, "
                     "whoever ran it (scripts sharing the machine should pass PREFIX)")
    p_down.add_argument("prefix", nargs="?", help="only this cluster (any origin)")
    p_down.add_argument("--all", action="store_true",
                        help="every dtrun test cluster and leftover on this machine, whoever made it")
    sub.add_parser("status", help="list known clusters and leftovers")
    return parser


def _up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        faults = _parse_fault_specs(args.fault)
        cluster_faults = {f.strip() for spec in args.cluster_fault for f in spec.split(",") if f.strip()}
        deny = [_parse_pair(spec) for spec in args.deny_ssh]
        cluster = Cluster(args.n, faults=faults, cluster_faults=cluster_faults, prefix=args.prefix,
                          deny_ssh=deny)
    except (ValueError, KeyError) as exc:
        parser.error(str(exc.args[0]) if exc.args else str(exc))
    try:
        cluster.up()
    except ClusterError as exc:
        print(f"nscluster: {exc}", file=sys.stderr)
        return 1
    if args.hold:
        return _hold(cluster)
    cluster.detach()  # outlive this process; `down` finds it through the state file
    if args.json:
        print(json.dumps(cluster.state(), indent=2))
    else:
        _print_cluster(cluster)
    return 0


def _hold(cluster: Cluster) -> int:
    """Keep an `up --hold` cluster in the foreground until Ctrl-C or SIGTERM, then tear it down."""
    cluster.origin = "cli"
    cluster._write_state()
    _print_cluster(cluster)
    print("holding; Ctrl-C or SIGTERM tears it down", flush=True)
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        cluster.down()
    return 0


def _down(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.prefix and not _PREFIX_RE.match(args.prefix):
        parser.error(f"prefix {args.prefix!r} must match {_PREFIX_RE.pattern}")
    if args.all:
        left = down_all()
    else:
        left = []
        targets = ([STATE_DIR / f"{args.prefix}.json"] if args.prefix else
                   [p for p in _state_files() if _origin(p) == "cli"])
        if args.prefix and not targets[0].exists():
            # No state (crashed `up`?): remove whatever carries the name.
            left = down_prefix(args.prefix)
            print(f"cluster {args.prefix}: no state file; removed leftovers by name")
            targets = []
        for path in targets:
            cluster = Cluster.from_state(path)
            try:
                cluster.down()
                print(f"cluster {cluster.prefix}: down")
            except ClusterError as exc:
                left.append(str(exc))
    for item in left:
        print(f"nscluster: leftover: {item}", file=sys.stderr)
    return 1 if left else 0


def _status() -> int:
    for path in _state_files():
        with contextlib.suppress(ValueError, KeyError, OSError):
            cluster = Cluster.from_state(path)
            alive = all(h.netns in _netns_list() for h in cluster.hosts) and bool(cluster.hosts)
            print(f"# {'up' if alive else 'BROKEN'} (origin {cluster.origin})")
            _print_cluster(cluster)
    stray = leftovers()
    known = {p.stem for p in _state_files()}
    stray = [s for s in stray if not any(k in s for k in known)]
    for item in stray:
        print(f"leftover: {item}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "up":
        return _up(args, parser)
    if args.command == "down":
        return _down(args, parser)
    if args.command == "status":
        return _status()
    return 2
