"""Ranks of one host signalling each other through counters in shared memory.

Why not ``MPI_Barrier``: Open MPI busy-polls while it waits. With a core shared (another
job, a CPU hog, more ranks than cores) the waiting rank burns the very core the late rank
needs, and each phase of the shared-memory allreduce stretches to a scheduler time slice.
Here a rank waiting for another

1. spins on the other's counter for a few microseconds (the common case: both ranks are
   on-CPU and the other is a moment behind);
2. then ``sched_yield``s for a while (another runnable task on this core gets it);
3. then sleeps on the counter's address with a futex (Linux) until the other rank
   posts, or 2 ms pass (a safety net, never needed for correctness). The poster wakes
   sleepers only when a sleeper announced itself, so the fast path makes no system call.

Each rank owns one header of ``header_bytes(n)`` bytes in the shared window: an int64
counter (the last epoch it posted) and one int64 "asleep on my counter" flag per rank.
Stores to aligned int64 are atomic; ``fence`` (``MPI_Win_sync``, a full memory barrier
in Open MPI's osc/sm) orders the data written before a post against the post, and the
post against the sleeper check (store->load order, which x86 does not keep by itself).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time

import numpy as np

SPINS = 300       # counter reads before yielding (~20-40 us in CPython)
YIELDS = 40       # sched_yield calls before sleeping (0 measured 20-30 % slower with a busy core)
SLEEP_S = 2e-3    # futex timeout: the longest a missed wake-up can cost

# futex(2) system call numbers; elsewhere the sleep phase falls back to time.sleep.
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98,
              "ppc64le": 221, "s390x": 238, "riscv64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex():
    """``(wait(addr, expected, timeout_s), wake(addr))`` over futex(2), or None."""
    if _SYS_FUTEX is None or not sys.platform.startswith("linux"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    nr = ctypes.c_long(_SYS_FUTEX)
    timeout = _Timespec(0, int(SLEEP_S * 1e9))
    tref = ctypes.byref(timeout)

    def wait(addr: int, expected: int) -> None:
        # Shared (not FUTEX_PRIVATE) futex: the word lives in memory mapped by several processes.
        syscall(nr, ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
                ctypes.c_uint32(expected & 0xFFFFFFFF), tref, None, ctypes.c_int(0))

    def wake(addr: int) -> None:
        syscall(nr, ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))
    return wait, wake


_FUTEX = _futex()
# The futex compares the 32-bit word at the address: the counter's low half.
_LOW_OFFSET = 0 if sys.byteorder == "little" else 4


def header_bytes(n: int) -> int:
    """Bytes of one rank's header: counter + one flag per rank, whole cache lines."""
    return -(-8 * (1 + n) // 64) * 64


class Signals:
    """Counters of the ``n`` ranks of a host, one header each in shared memory.

    Args:
        headers: ``headers[k]`` is rank k's header as a uint8 array (``header_bytes(n)``).
        me: this rank's index.
        fence: a full memory barrier (``win.Sync``), or None.
    """

    def __init__(self, headers: list[np.ndarray], me: int, fence=None) -> None:
        self.n = len(headers)
        self.me = me
        self.ctl = [h.view(np.int64) for h in headers]  # [0]: counter; [1 + k]: k asleep
        self.addr = [h.ctypes.data + _LOW_OFFSET for h in headers]
        self.others = [k for k in range(self.n) if k != me]
        self.fence = fence or (lambda: None)
        self.epoch = 0
        self.slept = 0  # times this rank went to sleep (tests and benchmarks read it)
        self.ctl[me][:] = 0

    def sync(self) -> None:
        """Barrier among the host's ranks: post the next epoch, wait for everyone's."""
        e = self.epoch = self.epoch + 1
        self.post(e)
        self.wait_all(e)

    def post(self, epoch: int) -> None:
        mine = self.ctl[self.me]
        fence = self.fence
        fence()          # the data this rank wrote is visible before the counter is
        mine[0] = epoch
        fence()          # ... and the counter before the sleeper flags are read
        for k in self.others:
            if mine[1 + k]:
                if _FUTEX is not None:
                    _FUTEX[1](self.addr[self.me])
                break

    def wait_all(self, epoch: int) -> None:
        for k in self.others:
            c = self.ctl[k]
            if c[0] < epoch:
                self._wait(k, c, epoch)
        self.fence()  # reads of the others' data happen after their counters were seen

    def _wait(self, k: int, c: np.ndarray, epoch: int) -> None:
        for _ in range(SPINS):
            if c[0] >= epoch:
                return
        for _ in range(YIELDS):
            os.sched_yield()
            if c[0] >= epoch:
                return
        flag = 1 + self.me
        self.slept += 1
        while True:
            seen = int(c[0])
            if seen >= epoch:
                break
            c[flag] = 1
            self.fence()  # the flag is visible before the counter is read again
            seen = int(c[0])
            if seen >= epoch:
                break
            if _FUTEX is not None:
                _FUTEX[0](self.addr[k], seen)
            else:
                time.sleep(50e-6)
        c[flag] = 0
