"""``horovod.runner.util.threads`` under ``dtrun --horovod``: ``in_thread``."""

from __future__ import annotations

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False) -> threading.Thread:
    """Start ``target(*args)`` on a new thread and return the thread; ``silent`` drops any
    exception ``target`` raises instead of letting the thread report it."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}; for one argument use (arg,)")

    def quietly(*a):
        try:
            target(*a)
        except BaseException:  # noqa: BLE001 (silent=True asks for exactly this)
            pass

    thread = threading.Thread(target=quietly if silent else target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
