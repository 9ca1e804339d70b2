"""Every stop signal from dtrun's start to its exit, in one place.

dtrun installs one handler for every catchable terminating signal as its very first step
(``install``, from the console script), so no signal ever meets Python's default action
(SIGTERM: a silent death that leaves mpirun running in its own session; SIGINT: a
``KeyboardInterrupt`` wherever the main thread happens to be). What a signal does depends
on the moment it arrives:

* **before a job starts** (argument parsing, the preflight over ssh): ``Stopped`` is raised
  where the main thread is, and the work unwinds (``subprocess.run`` ends its child);
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


_gate = _Gate()


def _handler(signum: int, _frame) -> None:
    g = _gate
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


def installed() -> bool:
    return _gate.installed


def uninstall() -> None:
    """Restore the handlers ``install`` replaced (for callers that run a job as a library)."""
    for s, h in _gate.previous.items():
        with contextlib.suppress(OSError, ValueError):
            signal.signal(s, h)
    _gate.previous.clear()
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
