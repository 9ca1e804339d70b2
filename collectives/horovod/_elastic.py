"""Horovod's elastic API (``hvd.elastic``), framework-neutral half: ``State``, ``ObjectState``
and ``run_fn``, on dtrun's restarts.

Horovod's elastic mode keeps running processes and re-forms the job around them. Under
dtrun an MPI job cannot change its members, so a change of hosts is a new attempt of the
run, and the training state travels through commits:

* ``state.commit()`` keeps the state in memory (``restore()`` returns to it) and, when dtrun
  restarts the run (``--max-restarts``), on each host's own disk (dtrun/commitstore.py);
* when a host is lost, dtrun starts the next attempt without it; ``hvd.elastic.run`` finds the
  newest commit on the hosts that remain and broadcasts it from there: the job goes on from
  its last commit, without a checkpoint file or a shared directory;
* when dtrun's ``--host-discovery-script`` finds hosts to add (or hosts that went away), it
  posts a notice in the job directory of rank 0's host; the next ``commit()`` (or
  ``check_host_updates()``) sees it on every rank at once and raises
  ``HostsUpdatedInterrupt``; ``hvd.elastic.run`` then ends every rank with ``RESET_EXIT_CODE``
  after that commit, and dtrun starts the next attempt on the new hosts, which resumes from it.

Reset callbacks run whenever an attempt resumes from a commit (the job's size may differ).
"""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import re
import socket
import sys
import threading
from typing import Any, Callable

from dtrun import commitstore
from . import _core
from ._engine import HorovodInternalError, HostsUpdatedInterrupt

# The exit code of every rank that leaves at a commit for a change of hosts; dtrun takes it
# for a reset only when it posted the notice itself (launcher/elastic.py).
RESET_EXIT_CODE = 75
NOTICE = "hosts.updated"
_NOTICE_RE = re.compile(rb"(\d{1,18}) (added|removed)\n?")
ADDED, REMOVED = 1, 2


def read_notice(job_dir: str | None) -> tuple[int, int]:
    """(timestamp, ADDED|REMOVED bits) of dtrun's notice in ``job_dir``; (0, 0) when none.
    The file is dtrun's (this user's private job directory); anything else is ignored."""
    if not job_dir:
        return 0, 0
    try:
        fd = os.open(os.path.join(job_dir, NOTICE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0, 0
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not (st.st_mode & 0o170000 == 0o100000):
            return 0, 0
        data = os.read(fd, 64)
    finally:
        os.close(fd)
    m = _NOTICE_RE.fullmatch(data)
    if m is None:
        return 0, 0
    return int(m[1]), ADDED if m[2] == b"added" else REMOVED


class State:
    """State kept across resets (Horovod's ``horovod.common.elastic.State``).

    Args:
        bcast_object: broadcasts a picklable object from rank 0.
        get_rank: this process's rank.
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._last_updated_timestamp = 0
        self._reset_callbacks: list = []
        self._commits = 0  # commits made in the run (carried across attempts by the store)

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions to call after each reset (a host lost or added), e.g. to scale the
        learning rate to the new number of ranks."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the state (``restore()`` returns to it; a restarted job resumes from it), then
        check for host updates: raises ``HostsUpdatedInterrupt`` on every rank when dtrun
        found hosts to add or remove."""
        self.save()
        self._commits += 1
        _persist(self)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank at once when dtrun posted a change
        of hosts since the last check (rank 0 reads the notice; all ranks get its answer)."""
        seen = read_notice(os.environ.get("DTRUN_JOB_DIR")) if self._rank() == 0 else (0, 0)
        prev = self._last_updated_timestamp
        prev, latest, update = self._bcast_object((prev, max(prev, seen[0]), seen[1] if seen[0] > prev else 0))
        self._last_updated_timestamp = latest
        if latest > prev:
            raise HostsUpdatedInterrupt(update == REMOVED)

    # The framework's state classes fill these in.
    def save(self) -> None:
        """Keep the current state in memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Return to the last committed state, undoing what came after it."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Called on a reset, before the state is synchronised."""

    # What a commit keeps on disk: the saved state, picklable; a restarted attempt loads it.
    def _snapshot(self) -> Any:
        raise NotImplementedError()

    def _load_snapshot(self, snap: Any) -> None:
        raise NotImplementedError()


class ObjectState(State):
    """Plain Python objects as state: each keyword argument becomes an attribute."""

    def __init__(self, bcast_object: Callable, get_rank: Callable, **kwargs: Any):
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def _snapshot(self) -> Any:
        return {"objects": self._saved_state}

    def _load_snapshot(self, snap: Any) -> None:
        self._saved_state = dict(snap["objects"])


# ----------------------------------------------------------------------------- commits
def _store():
    try:
        return commitstore.for_this_run()
    except ValueError:
        return None


class _Writer:
    """Writes each commit to the host's disk on a thread of its own, one at a time, so that a
    commit costs the training loop its in-memory copy only. What it writes is private: the
    copies ``save()`` made, and the plain attributes pickled before ``commit()`` returns."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error = ""

    def submit(self, store, seq: int, size: int, objects: bytes, copies: dict) -> None:
        self.wait()

        def write() -> None:
            try:
                payload = pickle.dumps({"objects_pickled": objects, **copies}, protocol=pickle.HIGHEST_PROTOCOL)
                store.write(seq, size, payload)
            except (OSError, pickle.PicklingError, TypeError, ValueError) as exc:
                self._error = f"dtrun elastic: commit {seq} could not be kept on this host's disk: {exc}"
        self._thread = threading.Thread(target=write, name="dtrun-elastic-commit", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the last commit is on disk (said once on stderr if it could not be)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error:
            print(self._error, file=sys.stderr, flush=True)
            self._error = ""


_WRITER = _Writer()
atexit.register(_WRITER.wait)


def _persist(state: State) -> None:
    """Keep the commit on this host (local rank 0 of each host) when dtrun restarts the run."""
    store = _store()
    if store is None:
        return
    j = _core.job("commit")
    if j.local_rank != 0:
        return
    snap = dict(state._snapshot())
    # The plain attributes are the program's own objects, which may change once commit()
    # returns: pickled now. The rest are save()'s private copies.
    objects = pickle.dumps(snap.pop("objects", {}), protocol=pickle.HIGHEST_PROTOCOL)
    _WRITER.submit(store, state._commits, j.size, objects, snap)


def _unpack(payload: bytes):
    snap = pickle.loads(payload)
    snap["objects"] = pickle.loads(snap.pop("objects_pickled"))
    return snap


def _resume(state: State) -> bool:
    """Load the newest commit any host of this attempt holds into ``state`` (collective).
    Returns whether there was one."""
    store = _store()
    if store is None:
        return False
    j = _core.job("elastic.run")
    found, problem = None, ""
    if j.local_rank == 0:
        try:
            found = store.read()
        except OSError as exc:  # CommitStoreError too: every rank must reach the allgather below
            problem = str(exc)
    seqs = _core.allgather_object((found.seq if found else -1, problem, socket.gethostname()),
                                  name="dtrun.elastic.seqs")
    for r, (_, why, _) in enumerate(seqs):
        if why and j.rank == 0:
            print(f"dtrun elastic: rank {r}'s host commit left out: {why}", file=sys.stderr, flush=True)
    best = max(s for s, _, _ in seqs)
    if best < 0:
        return False
    src = [s for s, _, _ in seqs].index(best)
    blob = _core.broadcast_object((found.size, found.payload) if j.rank == src else None, root_rank=src,
                                  name="dtrun.elastic.commit")
    size, payload = blob
    state._load_snapshot(_unpack(payload))
    state._commits = best
    state.restore()
    if j.rank == 0:
        print(f"dtrun elastic: resumed from commit {best} (made by {size} rank{'s' if size != 1 else ''}), "
              f"held on {seqs[src][2]}; {j.size} rank{'s' if j.size != 1 else ''} now", file=sys.stderr,
              flush=True)
    return True


def _finish() -> None:
    """The elastic function returned on every rank: the run's commits are no longer needed."""
    store = _store()
    if store is None:
        return
    _WRITER.wait()
    _core.barrier()
    if _core.job("elastic.run").local_rank == 0:
        store.remove()


def _leave_for_reset(state: State) -> None:
    """Every rank raised HostsUpdatedInterrupt at the same commit: end this attempt so that
    dtrun starts the next on the new hosts (it resumes from that commit). MPI is finalised
    first, so the launcher sees a plain exit with ``RESET_EXIT_CODE`` on every rank (a
    SystemExit would make mpi4py abort the job)."""
    j = _core.job("elastic.run")
    if j.rank == 0:
        print(f"dtrun elastic: hosts changed; leaving at commit {state._commits} for dtrun to start the job "
              "on the new hosts", file=sys.stderr, flush=True)
    _WRITER.wait()  # the commit the next attempt resumes from is on disk
    _core.barrier()
    _core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # hvd.init() started it (this module never imports MPI)
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(RESET_EXIT_CODE)


def run_fn(func: Callable, reset: Callable) -> Callable:
    """Horovod's ``run_fn``: ``func(state, ...)`` runs from the newest commit, again after each reset."""
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        if _resume(state):
            state.on_reset()
        while True:
            try:
                if not skip_sync:
                    state.sync()
                result = func(state, *args, **kwargs)
                _finish()
                return result
            except HorovodInternalError:
                _WRITER.wait()  # restore() may share tensors with the copy being written
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                if _store() is not None and os.environ.get("DTRUN_JOB_DIR"):
                    _leave_for_reset(state)
                skip_sync = e.skip_sync
            reset()
            state.on_reset()
    return wrapper
