"""Rank program for tests/test_horovod_timeline.py: run under ``dtrun -np 2``.

Written as a Horovod user turns the timeline on (the variables set before ``hvd.init()``, as
Horovod's own tests do):

* ``env``: ``HOROVOD_TIMELINE=OUT/timeline.json`` and ``HOROVOD_TIMELINE_MARK_CYCLES=1``; one
  allreduce named ``test_allreduce``. Rank 0 waits for its file to show it while the timeline
  still runs (written live), then everything is read after ``hvd.shutdown()``.
* ``dynamic``: ``HOROVOD_TIMELINE=DYNAMIC``; an allreduce before ``start_timeline`` (never
  written), then ``start_timeline(OUT/dyn1.json, mark_cycles=True)``, an allreduce,
  ``stop_timeline()``; then the same into ``OUT/dyn2.json`` with ``mark_cycles=False``.

Rank 0 prints what each file holds (``RESULT {json}``): per rank (Chrome pid), the tensor rows
and their phases, the CYCLE_START count, and whether every begin has its end.
Usage: python tests/horovod_timeline_cases.py OUT MODE
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

OUT, MODE = Path(sys.argv[1]), sys.argv[2]
if MODE == "env":
    os.environ["HOROVOD_TIMELINE"] = str(OUT / "timeline.json")
    os.environ["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
else:
    os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"

import torch  # noqa: E402

import dtrun.collectives.horovod.torch as hvd  # noqa: E402


def summary(path: Path) -> dict:
    """What a timeline file holds, per Chrome pid (rank)."""
    events = json.loads(path.read_text())
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("name") == "thread_name"}
    per: dict = {}
    depth: dict = {}
    for e in events:
        p = per.setdefault(str(e.get("pid")), {"phases": [], "cycles": 0, "epoch": False})
        if e.get("name") == "process_name":
            p["epoch"] = "start_time_since_epoch_in_micros" in e["args"]
        if e.get("name") == "CYCLE_START":
            p["cycles"] += 1
        if e["ph"] in ("B", "E"):
            key = (e["pid"], e["tid"])
            depth[key] = depth.get(key, 0) + (1 if e["ph"] == "B" else -1)
        if e["ph"] == "B":
            p["phases"].append([rows[(e["pid"], e["tid"])], e["name"]])
    return {"ranks": per, "balanced": all(v == 0 for v in depth.values())}


def wait_for(path: Path, needles: list[str], timeout: float = 60.0) -> bool:
    """Whether the file shows every needle within ``timeout`` (it is written live)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if all(n in text for n in needles):
            json.loads(text)  # valid while the timeline runs
            return True
        time.sleep(0.05)
    return False


def allreduce(name: str) -> None:
    hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name=name)


hvd.init()
res: dict = {"rank": hvd.rank()}
if MODE == "env":
    allreduce("test_allreduce")
    if hvd.rank() == 0:
        res["live"] = wait_for(OUT / "timeline.json", ["allreduce.test_allreduce",
                                                       "NEGOTIATE_ALLREDUCE", "CYCLE_START"])
    hvd.shutdown()
    if res["rank"] == 0:
        res["file"] = summary(OUT / "timeline.json")
else:
    allreduce("before_start")
    res["no_file_before"] = not (OUT / "dyn1.json").exists()
    hvd.start_timeline(str(OUT / "dyn1.json"), mark_cycles=True)
    allreduce("test_allreduce")
    hvd.stop_timeline()
    hvd.start_timeline(str(OUT / "dyn2.json"), mark_cycles=False)
    allreduce("test_allreduce")
    hvd.stop_timeline()
    hvd.stop_timeline()  # stopped already: nothing to do, as in Horovod
    if res["rank"] == 0:
        res["dyn1"], res["dyn2"] = summary(OUT / "dyn1.json"), summary(OUT / "dyn2.json")
    hvd.shutdown()
print("RESULT " + json.dumps(res), flush=True)
