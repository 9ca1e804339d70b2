"""Checkpoint behaviours that tests/test_checkpoint.py checks from outside, one per mode.

Usage: python tests/checkpoint_cases.py MODE PATH [ARG]   (alone or under ``dtrun -np N``;
prints ``RESULT {json}`` per rank)

Modes:
  save          save {"step": 7, "w": ones(64)} at PATH
  save-on-go    print ``ready``, wait for a line on stdin, then save as ``save`` does
  save-bad      save a state that cannot be pickled: ARG ``lambda`` or ``reduce`` (its
                __reduce__ raises)
  save-killed   save a state whose pickling SIGKILLs this process (a job killed mid-write)
  load          load PATH (ARG ``trusted``: with trusted=True); report the state or the error
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

import dtrun.collectives.dp as dp


def report(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


class RaisesOnPickle:
    def __reduce__(self):
        raise ValueError("this object refuses to be pickled")


class KillsOnPickle:
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def state_of(mode: str, arg: str) -> dict:
    if mode == "save-bad":
        return {"step": 1, "bad": (lambda x: x) if arg == "lambda" else RaisesOnPickle()}
    if mode == "save-killed":
        return {"w": torch.ones(1 << 16), "bad": KillsOnPickle()}
    return {"step": 7, "w": torch.ones(64)}


def main(mode: str, path: str, arg: str = "") -> None:
    ctx = dp.init()
    try:
        if mode == "load":
            state = dp.load_checkpoint(path, trusted=arg == "trusted")
            summary = None if state is None else {"step": state.get("step"), "w": state["w"].sum().item()
                                                 if "w" in state else None}
            report(rank=ctx.rank, state=summary)
            return
        if mode == "save-on-go":
            print("ready", flush=True)
            sys.stdin.readline()
        dp.save_checkpoint(path, state_of(mode, arg))
        report(rank=ctx.rank, saved=True)
    except Exception as e:  # the test reads what each rank saw
        report(rank=ctx.rank, type=type(e).__name__, oserror=isinstance(e, OSError), error=str(e))


if __name__ == "__main__":
    main(*sys.argv[1:])
