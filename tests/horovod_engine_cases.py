"""Rank program for tests/test_horovod_engine.py: the Horovod adapter's negotiation engine
on NumPy arrays (no framework), run under ``dtrun -np 2``. ``python
tests/horovod_engine_cases.py CASE``, CASE one of

* ``background``: rank 0 submits an allreduce and never calls poll or synchronize; rank 1
  submits it half a second later: the handle completes on rank 0 by itself;
* ``threads``: four threads per rank submit named allreduces, in opposite orders on the two
  ranks, each blocking in synchronize: every pair meets its partner;
* ``deadlock``: each rank blocks on a name the other never submits: an error naming both
  ranks' names, on both ranks, after DTRUN_HVD_DEADLOCK_S;
* ``sets``: a second init returns the same job; process sets {0}, {1} and {0, 1} run their own
  allreduces (rank 1's set while rank 0 is busy in another), a non-member's call and a
  removed set fail with ValueError, an unknown op too.

Each rank prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

from dtrun.collectives.horovod import _core

CASE = sys.argv[1]
job = _core.init()
R = job.rank
res: dict = {"rank": R, "case": CASE}


def submit(name: str, value: float, sc=None):
    engine, comm = (job.engine, job.comm) if sc is None else (sc.engine, sc.comm)
    x = np.full(3, value)
    return engine.submit(_core.Request("allreduce", name, (x.shape,), ("float64",), "sum", -1,
                                       lambda: comm.allreduce(x, op="sum")))


def outcome(call) -> list:
    try:
        return ["ok", call()]
    except Exception as e:  # noqa: BLE001 — the type and message are the result
        return [type(e).__name__, str(e)]


def background() -> None:
    if R == 1:
        time.sleep(0.5)
        res["value"] = job.engine.synchronize(submit("a", 2.0)).tolist()
        return
    h = submit("a", 1.0)
    deadline = time.monotonic() + 30
    while not h.request.done and time.monotonic() < deadline:
        time.sleep(0.01)  # neither poll nor synchronize: only the engine's thread
    res["done_by_itself"] = h.request.done
    res["value"] = job.engine.synchronize(h).tolist()


def threads() -> None:
    out: dict = {}

    def one(i: int) -> None:
        out[f"t{i}"] = job.engine.synchronize(submit(f"t{i}", 10.0 * i + R)).tolist()[0]

    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in (ts if R == 0 else ts[::-1]):
        t.start()
        time.sleep(0.02)
    for t in ts:
        t.join(60)
    res["sums"] = out


def deadlock() -> None:
    start = time.monotonic()
    res["error"] = outcome(lambda: job.engine.synchronize(submit(f"only_on_{R}", 1.0)))
    res["waited"] = time.monotonic() - start
    res["after"] = job.engine.synchronize(submit("after", 1.0)).tolist()  # still in step


def sets() -> None:
    res["same_job"] = _core.init() is job
    mine = _core.add_process_set([0])
    theirs = _core.add_process_set([1])
    both = _core.add_process_set(_core.ProcessSet([0, 1]))
    res["ids"] = [mine.process_set_id, theirs.process_set_id, both.process_set_id]
    res["included"] = [mine.included(), theirs.included(), both.included()]
    own = mine if R == 0 else theirs
    sc = _core.scope(own, "allreduce")
    if R == 0:  # rank 0 is busy in its own set while rank 1 runs in its set
        time.sleep(0.3)
    res["own_set"] = sc.engine.synchronize(submit("s", 5.0 + R, sc)).tolist()
    res["both_set"] = _core.scope(both, "allreduce").engine.synchronize(
        submit("b", 1.0, _core.scope(both, "allreduce"))).tolist()
    other = theirs if R == 0 else mine
    res["non_member"] = outcome(lambda: _core.scope(other, "allreduce"))
    res["duplicate"] = outcome(lambda: _core.add_process_set([1, 0]))
    res["removed"] = [_core.remove_process_set(s) for s in (mine, theirs, both)]
    res["after_remove"] = outcome(lambda: _core.scope(both, "allreduce"))
    res["bad_op"] = outcome(lambda: _core.check_op("bogus", "allreduce"))


{"background": background, "threads": threads, "deadlock": deadlock, "sets": sets}[CASE]()
print("RESULT " + json.dumps(res), flush=True)
