"""Open MPI's tree spawn: which hosts ssh to which, and what the hops' outcomes mean (pure).

With more than a few hosts, Open MPI's daemons start each other over ssh along a tree
(``plm_ssh_no_tree_spawn`` off), so a host that cannot ssh to its children hangs the job
though this host reaches every one. ``ssh_hops`` says which hops the doctor tries (the
tree's, or every pair with ``--all-pairs``); ``ssh_pair_findings`` turns their outcomes
into findings. Apart from the doctor's rounds because it is pure and the scale tests
use it alone.
"""
from __future__ import annotations

import os

from dtrun.checks.result import FAIL, OK, Finding
from dtrun.launcher.command import tree_radix


def radix_parent(vpid: int, radix: int) -> int:
    """The daemon that starts daemon ``vpid`` in Open MPI's routing tree (-1 for mpirun, vpid 0).

    PRRTE's routed/radix (and ORTE's before it) numbers the tree by levels of radix**k
    daemons: daemon v at a level of L daemons starts v+L, v+2L, ... v+radix*L, so a
    level's children are interleaved across its daemons (with radix 64: 1 starts 65, 129,
    ...; 2 starts 66, 130, ...).
    """
    if vpid <= 0:
        return -1
    total, in_level = 1, 1
    while total < vpid + 1:
        in_level *= radix
        total += in_level
    first = total - in_level  # the first vpid of vpid's level
    in_prev = in_level // radix
    return (vpid - first) % in_prev + (first - in_prev)


def tree_spawn_pairs(hosts: list[str], radix: int, launcher_in_list: bool = False) -> list[tuple[str, str]]:
    """(parent, child) ssh hops of Open MPI's routing tree (pure).

    mpirun is daemon 0; the hosts get daemons 1..N in order (or 0..N-1 when this host is
    one of them), as PRRTE's ``plm_base_verbose`` shows ("assigning new daemon [..,65] to
    node h65"). Daemon 0 is this host, whose own ssh the ssh check already covers.
    """
    offset = 0 if launcher_in_list else 1
    by_vpid = {i + offset: h for i, h in enumerate(hosts)}
    pairs = []
    for v, h in sorted(by_vpid.items()):
        parent = radix_parent(v, radix)
        if parent > 0 and parent in by_vpid:
            pairs.append((by_vpid[parent], h))
    index = {h: i for i, h in enumerate(hosts)}
    return sorted(pairs, key=lambda p: (index[p[0]], index[p[1]]))


def ssh_hops(all_pairs: bool, names: list, launcher_in_list: bool):
    """Which host-to-host ssh hops to try, and why (the radix comes from the environment, as mpirun's does)."""
    if all_pairs:
        return [(a, b) for a in names for b in names if a != b], "--all-pairs"
    radix = tree_radix(os.environ)
    return (tree_spawn_pairs(names, radix, launcher_in_list),
            f"{len(names)} hosts: Open MPI's daemons start each other over ssh (tree spawn, radix {radix})")


def ssh_pair_findings(results: dict, why: str, all_pairs: bool) -> list[Finding]:
    """Host-to-host ssh outcomes → findings on the source host (pure)."""
    out = []
    for src, row in results.items():
        if not row:
            continue
        bad = {dst: r for dst, r in row.items() if r[0] != 0}
        if bad:
            text = "; ".join(f"{src} → {dst}: {(r[2] or 'exit ' + str(r[0])).splitlines()[-1]}" for dst, r in bad.items())
            fix = ("pass --no-tree-spawn to dtrun (mpirun: --prtemca plm_ssh_no_tree_spawn 1) so that only this "
                   f"host uses ssh, or let {src} log in to {', '.join(bad)} with a key and a known host key")
            out.append(Finding(src, "ssh", FAIL, f"ssh between hosts fails ({why}): {text}", fix))
        else:
            out.append(Finding(src, "ssh", OK, f"ssh from {src} to {len(row)} other host(s) works ({why})"))
    return out
