"""One step on every host at once, and an answer for every host (like fabric's ``Group``).

``fan_out`` runs ``work(item)`` for each host in a thread pool and never stops at a
failure: each host ends up in ``HostResults.ok`` or ``HostResults.failed``. The ssh
connections, keyscan, the preflight and each round of doctor use it, so it lives
apart from any one of them.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from dtrun.checks.errors import CheckError
from dtrun.checks.result import HostResults


def fan_out(items: Sequence, work, workers: int = 32, key=lambda item: item.name):
    """``work(item)`` for every item (a target, a host) in parallel, never stopping at a failure.

    Returns:
        ``HostResults``: ``ok`` holds each result and ``failed`` each ``CheckError`` raised,
        keyed by ``key(item)`` (the host's name).
    """
    def one(item):
        try:
            return True, work(item)
        except CheckError as exc:
            return False, exc

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items)))) as pool:
        answers = list(pool.map(one, items))
    ok, failed = {}, {}
    for item, (fine, value) in zip(items, answers):
        (ok if fine else failed)[key(item)] = value
    return HostResults(ok, failed)
