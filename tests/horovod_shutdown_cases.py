"""Rank program for tests/test_horovod_torch.py's shutdown and wrong-argument tests: run
under ``dtrun -np 2``. ``python tests/horovod_shutdown_cases.py CASE``, CASE one of

* ``shutdown``: rank 1 calls ``hvd.shutdown()`` and ends while rank 0 waits in
  ``hvd.allreduce``; rank 0 then tries an allreduce, a barrier and ``broadcast_object``,
  shuts down itself and tries an allreduce again;
* ``exit``: rank 1's program ends without ``hvd.shutdown()`` while rank 0 spins on
  ``hvd.poll`` (Horovod shuts down at exit);
* ``die``: rank 1 ends without MPI_Finalize (``os._exit(0)``) while rank 0 spins on
  ``hvd.poll``: the launcher must end the job, naming rank 1;
* ``late_news``: rank 0 shuts down right after an allreduce that rank 1 submitted late:
  that one ran on both, rank 1's next collective fails;
* ``not_a_tensor``: rank 1 passes lists where rank 0 passes tensors (allreduce, then a
  grouped allreduce), then both run a correct allreduce.

Each rank prints ``RESULT {json}``: what every call raised (type and message), and the
seconds rank 0 waited.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import dtrun.collectives.horovod.torch as hvd

CASE = sys.argv[1]
hvd.init()
R = hvd.rank()
res: dict = {"rank": R, "case": CASE}


def attempt(what: str, call) -> None:
    """Record what ``call()`` raised under ``what`` (None: it returned)."""
    try:
        call()
        res[what] = None
    except Exception as e:  # noqa: BLE001 — the type and message are the result
        res[what] = [type(e).__name__, str(e)]


def wait_in_poll() -> None:
    """Rank 0: spin on poll until the handle is done (the peer leaves meanwhile)."""
    start = time.monotonic()
    h = hvd.allreduce_async(torch.ones(3))
    while not hvd.poll(h):
        pass
    res["waited"] = time.monotonic() - start
    attempt("synchronize", lambda: hvd.synchronize(h))


def shutdown_case() -> None:
    if R == 1:
        time.sleep(1.0)  # rank 0 is waiting in its allreduce by now
        hvd.shutdown()
        return
    start = time.monotonic()
    attempt("allreduce", lambda: hvd.allreduce(torch.ones(3)))
    res["waited"] = time.monotonic() - start
    attempt("later allreduce", lambda: hvd.allreduce(torch.ones(3), name="later"))
    attempt("barrier", hvd.barrier)
    attempt("broadcast_object", lambda: hvd.broadcast_object({"a": 1}, 0))
    hvd.shutdown()
    attempt("own shutdown", lambda: hvd.allreduce(torch.ones(3)))


def exit_case() -> None:
    if R == 1:
        time.sleep(1.0)
        return  # no hvd.shutdown(): the end of the program shuts Horovod down
    wait_in_poll()


def die_case() -> None:
    if R == 1:
        time.sleep(1.0)
        os._exit(0)  # no shutdown, no MPI_Finalize
    wait_in_poll()


def late_news_case() -> None:
    if R == 0:  # runs "x" (waiting for rank 1), then shuts down at once
        attempt("allreduce", lambda: hvd.allreduce(torch.ones(3), name="x"))
        hvd.shutdown()
        return
    time.sleep(1.0)  # rank 0 waits in "x" meanwhile
    attempt("allreduce", lambda: hvd.allreduce(torch.ones(3), name="x"))
    attempt("later allreduce", lambda: hvd.allreduce(torch.ones(3), name="later"))


def not_a_tensor_case() -> None:
    t = torch.ones(3)
    attempt("allreduce", lambda: hvd.allreduce(t if R == 0 else [1.0, 2.0, 3.0]))
    group = [t, t] if R == 0 else [t, [1.0, 2.0]]
    attempt("grouped_allreduce", lambda: hvd.grouped_allreduce(group, op=hvd.Sum))
    res["after"] = hvd.allreduce(torch.full((2,), float(R)), op=hvd.Sum).tolist()


{"shutdown": shutdown_case, "exit": exit_case, "die": die_case, "late_news": late_news_case,
 "not_a_tensor": not_a_tensor_case}[CASE]()
print("RESULT " + json.dumps(res), flush=True)
