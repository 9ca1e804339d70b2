"""``dtrun hosts``: show the resolved hosts and slots as a table or JSON."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

from dtrun.launcher.hosts import HostOptions, resolve_hosts


@dataclass(frozen=True, kw_only=True)
class HostsQuery:
    hosts: HostOptions = HostOptions()
    json_out: bool = False


def show_hosts(q: HostsQuery) -> int:
    sel = resolve_hosts(q.hosts)
    for w in sel.warnings:
        print(f"dtrun: warning: {w}", file=sys.stderr)
    if q.json_out:
        print(json.dumps({
            "source": sel.source,
            "total_slots": sel.total_slots,
            "hosts": [{k: v for k, v in asdict(h).items() if v is not None} for h in sel.hosts],
        }, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(sel.hosts)} hosts, {sel.total_slots} slots from {sel.source}")
    for col in ("host", "slots", "max_slots", "user", "port", "identity_file"):
        table.add_column(col, justify="right" if col in ("slots", "max_slots", "port") else "left")
    for h in sel.hosts:
        table.add_row(h.host, str(h.slots), str(h.max_slots or ""), h.user or "", str(h.port or ""), h.identity_file or "")
    Console().print(table)
    return 0
