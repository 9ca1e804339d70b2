"""Every stop signal from dtrun's start to its exit, in one place.

dtrun installs one handler for every catchable terminating signal as its very first step
(``install``, from the console script), so no signal ever meets Python's default action
(SIGTERM: a silent death that leaves mpirun running in its own session; SIGINT: a
``KeyboardInterrupt`` wherever the main thread happens to be). What a signal does depends
on the moment it arrives:

* **before a job starts** (argument parsing, the preflight over ssh): ``Stopped`` is raised
  where the main thread is, and the work unwinds (``subprocess.run`` ends its child). Where
  the main thread is in code whose exceptions Python ignores (a weakref callback or
  ``__del__``: the import system runs one for every module lock it drops), the ``Stopped``
  would be lost: ``sys.unraisablehook`` catches it and a timer (SIGALRM, a few ms later)
  raises it again, once the main thread is back in ordinary code;
* **while held** (``held()``: from just before mpirun is started until a supervisor follows
  it, and while an attempt's leftovers are cleaned up): the signal is only recorded. On
  ``attach`` the supervisor receives every signal recorded so far, so there is no moment
  where mpirun runs with nobody to stop it; a hold that ends with a recorded signal no
  supervisor took raises ``Stopped`` at that safe point;
* **while a supervisor follows a job** (``attach``): the supervisor's handler stops the job
  (and escalates on the next signal); a handler that returns True consumed the signal
  (SIGQUIT with the rank wrapper is the stack dump, not a stop).
"""
from __future__ import annotations

import contextlib
import signal
import sys
# (no typing import: annotations stay strings, and this module must load in no time)

__all__ = ["STOP_SIGNALS", "Stopped", "attach", "attached", "detach", "exit_code", "held", "install", "installed",
           "uninstall"]

# Every signal that terminates a process by default and can be caught: each stops the job.
STOP_SIGNALS = tuple(s for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1,
                                 signal.SIGUSR2, signal.SIGALRM, getattr(signal, "SIGVTALRM", None),
                                 getattr(signal, "SIGPROF", None), getattr(signal, "SIGXCPU", None),
                                 getattr(signal, "SIGXFSZ", None), getattr(signal, "SIGPWR", None),
                                 getattr(signal, "SIGIO", None)) if s is not None)


class Stopped(BaseException):
    """A stop signal reached dtrun where no job was running. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way out swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Gate:
    def __init__(self) -> None:
        self.installed = False
        self.stops: list[int] = []  # stop signals acted on so far (SIGQUIT after one adds nothing)
        self.pending: list[int] = []  # recorded while held, not yet handed to a supervisor
        self.target: Optional[Callable[[int], bool]] = None
        self.holds = 0
        self.previous: dict = {}
        self.unraisable = None  # the sys.unraisablehook that install() replaced
        self.lost: Optional[int] = None  # a stop whose Stopped Python ignored, until it is raised again
        self.in_hook = False


_gate = _Gate()


# How long after a lost Stopped the timer raises it again: the main thread has left the
# callback that ignored it by then (and if not, it is caught and sent again).
RESEND_S = 0.005


def _handler(signum: int, _frame) -> None:
    g = _gate
    if g.lost is not None:
        if g.in_hook:
            signal.setitimer(signal.ITIMER_REAL, RESEND_S)  # not inside the hook: Python would ignore it
            return
        signum, g.lost = g.lost, None  # the timer, or any stop signal: the lost stop comes first
    if g.target is not None:
        if not g.target(signum):
            g.stops.append(signum)
        return
    if g.holds:
        g.pending.append(signum)
        return
    if signum == signal.SIGQUIT and g.stops:
        return  # already stopping: Ctrl-\ after Ctrl-C adds nothing
    g.stops.append(signum)
    raise Stopped(signum)


def _unraisable(args) -> None:
    """``sys.unraisablehook``: a ``Stopped`` that Python ignored (the handler ran inside a weakref
    callback or ``__del__``) is not acted on; the timer raises it again. Others go on to the hook
    this one replaced."""
    g = _gate
    if not isinstance(args.exc_value, Stopped):
        (g.unraisable or sys.__unraisablehook__)(args)
        return
    g.in_hook = True
    signum = args.exc_value.signum
    if g.stops and g.stops[-1] == signum:
        g.stops.pop()  # not acted on (else SIGQUIT raised again would count as a second one)
    g.lost = signum
    signal.setitimer(signal.ITIMER_REAL, RESEND_S)
    g.in_hook = False


def install() -> None:
    """Catch every stop signal from now on (the console script's first step). Idempotent."""
    if _gate.installed:
        return
    for s in STOP_SIGNALS:
        if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN:
            continue  # `nohup dtrun …`: a closed terminal must not stop the job
        try:
            _gate.previous[s] = signal.signal(s, _handler)
        except (OSError, ValueError):  # not the main thread (a library caller): nothing to install
            pass
    _gate.installed = bool(_gate.previous)
    if _gate.installed and signal.SIGALRM in _gate.previous:
        _gate.unraisable, sys.unraisablehook = sys.unraisablehook, _unraisable


def installed() -> bool:
    return _gate.installed


def uninstall() -> None:
    """Restore the handlers ``install`` replaced (for callers that run a job as a library)."""
    for s, h in _gate.previous.items():
        with contextlib.suppress(OSError, ValueError):
            signal.signal(s, h)
    _gate.previous.clear()
    if sys.unraisablehook is _unraisable:
        sys.unraisablehook = _gate.unraisable or sys.__unraisablehook__
    _gate.installed = False


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Record stop signals instead of raising them, for a stretch that must not be cut in two
    (starting mpirun and handing it to its supervisor; cleaning up an attempt). Leaving the
    outermost hold with a signal no supervisor took raises ``Stopped``."""
    _gate.holds += 1
    try:
        yield
    finally:
        _gate.holds -= 1
    if not _gate.holds and _gate.pending and _gate.target is None:
        signum = _gate.pending[0]
        _gate.pending.clear()
        _gate.stops.append(signum)
        raise Stopped(signum)


def attach(target: Callable[[int], bool]) -> None:
    """Send stop signals to ``target`` (a supervisor's handler, True when it consumed the
    signal), first every signal recorded while held."""
    _gate.target = target
    pending, _gate.pending = _gate.pending, []
    for signum in pending:
        if not target(signum):
            _gate.stops.append(signum)


def detach() -> None:
    _gate.target = None


def attached() -> bool:
    """Whether a supervisor takes the stop signals now."""
    return _gate.target is not None


def exit_code(signum: int) -> int:
    """dtrun's exit code after a stop signal: 128 + its number, as shells report it (SIGINT 130)."""
    return 128 + int(signum)
