"""The on-disk state of a cluster: ``STATE_DIR/<prefix>.json`` beside its workdir.

The state file is written before anything is created (so a crash leaves a trail) and
again on every change; another process rebuilds a handle from it (``Cluster.from_state``)
to list or tear down a cluster that the CLI's ``up`` left running.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .common import STATE_DIR, Host, _ClusterBase


class _State(_ClusterBase):
    """The Cluster's state file: written on each change, read back by ``from_state``."""

    @classmethod
    def from_state(cls, path: Path | str):
        """Rebuild a handle on a cluster made by another process (for ``down``/``status``)."""
        data = json.loads(Path(path).read_text())
        cluster = cls(data["n"], prefix=data["prefix"])
        cluster.subnet = data.get("subnet", "")
        cluster.gateway = data.get("gateway", "")
        cluster.origin = data.get("origin", "library")
        cluster.cluster_faults = frozenset(data.get("cluster_faults", []))
        cluster.hosts = [Host(**h) for h in data.get("hosts", [])]
        cluster._faults = {k: set(v) for k, v in data.get("faults", {}).items()} or cluster._faults
        cluster._denied = {tuple(p) for p in data.get("denied_ssh", [])}
        cluster._is_up = bool(cluster.hosts)
        return cluster

    def state(self) -> dict:
        return {
            "prefix": self.prefix, "n": self.n, "subnet": self.subnet, "gateway": self.gateway,
            "bridge": self.bridge, "workdir": str(self.workdir), "ssh_config": str(self.ssh_config),
            "hostfile": str(self.hostfile), "origin": self.origin, "pid": os.getpid(),
            "hosts": [dataclasses.asdict(h) for h in self.hosts],
            "faults": {k: sorted(v) for k, v in self._faults.items()},
            "cluster_faults": sorted(self.cluster_faults),
            "denied_ssh": sorted(self._denied),
        }

    def _write_state(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state(), indent=2) + "\n")
        tmp.replace(self.state_file)


def _state_files() -> list[Path]:
    return sorted(STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []


def _origin(path: Path) -> str:
    try:
        return json.loads(path.read_text()).get("origin", "library")
    except (OSError, ValueError):
        return "unknown"
