"""collectives.horovod._timeline: Horovod's timeline as a Chrome trace.

The engine's hooks called directly (one process): the file is written live and parses after
every event, Horovod's phase names and metadata, dynamic start/stop and Horovod's errors,
planted links and files of another user refused, rank 0 merging the other ranks' parts (and
only this job's and session's), hooks from several threads. Then 2 real ranks under dtrun
with ``HOROVOD_TIMELINE`` (tests/horovod_timeline_cases.py): rank 0's file holds both ranks'
``NEGOTIATE_ALLREDUCE`` and ``ALLREDUCE`` of ``allreduce.test_allreduce``."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading

import numpy as np
import pytest

from dtrun.collectives.horovod import _timeline as tl
from tests.dtrun_helpers import REPO, dtrun
from tests.horovod_common import results

CASES = str(REPO / "tests" / "horovod_timeline_cases.py")
NAME = "allreduce.test_allreduce"


@pytest.fixture(autouse=True)
def _fresh():
    tl.detach()
    yield
    tl.detach()


def _events(path) -> list[dict]:
    return json.loads(open(path).read())


def _phases(events: list[dict], pid: int = 0) -> list[tuple[str, str, str]]:
    """(tensor row, phase, name) of ``pid``'s begin/end events, in file order."""
    rows = {e["tid"]: e["args"]["name"] for e in events
            if e.get("name") == "thread_name" and e["pid"] == pid}
    return [(rows[e["tid"]], e["ph"], e.get("name", "")) for e in events
            if e["ph"] in "BE" and e["pid"] == pid]


def _one_allreduce(t, name: str = NAME) -> None:
    t.cycle_start()
    t.negotiate_start(name, "allreduce")
    t.negotiate_end(name, "allreduce", [0, 1])
    t.op_start(name, "allreduce")
    t.op_end(name, "allreduce", 12)


# ----------------------------------------------------------------------------- one rank
def test_env_timeline_is_live_chrome_trace_with_horovods_phases(tmp_path):
    path = tmp_path / "timeline.json"
    tl.attach(0, 1, None, environ={tl.ENV: str(path), tl.ENV_CYCLES: "1"})
    t = tl.current()
    assert t is not None and t.mark_cycles
    for hook in (t.cycle_start, lambda: t.negotiate_start(NAME, "allreduce"),
                 lambda: t.negotiate_end(NAME, "allreduce", [0]),
                 lambda: t.op_start(NAME, "allreduce"), lambda: t.op_end(NAME, "allreduce", 12)):
        hook()
        _events(path)  # parses after every event: written live
    text = path.read_text()
    for needle in (NAME, "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START",
                   "start_time_since_epoch_in_micros"):
        assert needle in text
    tl.detach()
    events = _events(path)
    assert _phases(events) == [(NAME, "B", "NEGOTIATE_ALLREDUCE"), (NAME, "E", ""),
                               (NAME, "B", "ALLREDUCE"), (NAME, "E", "")]
    ends = [e for e in events if e["ph"] == "E"]
    assert ends[0]["args"] == {"ranks": [0]} and ends[1]["args"]["bytes"] == 12
    ts = [e["ts"] for e in events if "ts" in e]
    assert ts == sorted(ts) and ts[0] >= 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert tl.current() is None


def test_dynamic_start_stop_as_horovod(tmp_path):
    tl.attach(0, 1, None, environ={tl.ENV: tl.DYNAMIC, tl.ENV_CYCLES: "1"})
    assert tl.current() is None and not list(tmp_path.iterdir())  # nothing until started
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    tl.start_timeline(str(one), mark_cycles=True)
    _one_allreduce(tl.current())
    tl.stop_timeline()
    tl.stop_timeline()  # stopped already: nothing to do
    assert tl.current() is None
    assert "CYCLE_START" in one.read_text() and len(_phases(_events(one))) == 4
    tl.start_timeline(two)  # mark_cycles=False overrides HOROVOD_TIMELINE_MARK_CYCLES
    first = tl.current()
    tl.start_timeline(two)  # the same file: kept open, as Horovod does
    assert tl.current() is first
    _one_allreduce(first, "allreduce.again")
    tl.start_timeline(one, mark_cycles=False)  # another file closes this one
    assert first._closed and tl.current() is not first
    tl.detach()
    assert "CYCLE_START" not in two.read_text()
    assert [p[0] for p in _phases(_events(two))] == ["allreduce.again"] * 4
    assert _phases(_events(one)) == []  # reopened and emptied, nothing recorded since


def test_errors_as_horovods():
    with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use hvd.init\(\)\.$"):
        tl.start_timeline("/tmp/x.json")
    with pytest.raises(ValueError, match="not been initialized"):
        tl.stop_timeline()
    tl.attach(0, 1, None, environ={})
    with pytest.raises(ValueError, match="^Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic "):
        tl.start_timeline("/tmp/x.json")
    tl.stop_timeline()  # nothing open: fine


def test_planted_link_and_foreign_files_are_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "timeline.json"
    link.symlink_to(victim)
    with pytest.warns(RuntimeWarning, match="is a symbolic link; the timeline never writes"):
        tl.attach(0, 1, None, environ={tl.ENV: str(link)})
    assert tl.current() is None
    with pytest.raises(tl.TimelineError, match=r"timeline on rank 0: .*timeline.json is a symbolic"):
        tl.start_timeline(str(link))
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made-through-link")
    with pytest.raises(tl.TimelineError, match="symbolic link"):
        tl.start_timeline(str(dangling))
    hard = tmp_path / "hard.json"
    os.link(victim, hard)
    with pytest.raises(tl.TimelineError, match="has other hard links"):
        tl.start_timeline(str(hard))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(tl.TimelineError, match="fifo.json"):
        tl.start_timeline(str(fifo))  # never blocks waiting for a reader
    assert victim.read_text() == "precious" and not (tmp_path / "made-through-link").exists()
    if os.geteuid() == 0:
        other = tmp_path / "other.json"
        other.write_text("theirs")
        os.chown(other, 65534, -1)
        with pytest.raises(tl.TimelineError, match="belongs to uid 65534"):
            tl.start_timeline(str(other))
        assert other.read_text() == "theirs"


# ----------------------------------------------------------------------------- several ranks
def _rank(path, rank: int, token: int = 7, session: int = 1) -> tl.Timeline:
    return tl.Timeline(str(path), rank, 2, True, token, session)


def test_rank0_merges_every_ranks_part_on_its_clock(tmp_path, monkeypatch):
    monkeypatch.setenv(tl.ENV_WAIT, "30")
    path = tmp_path / "timeline.json"
    r0 = _rank(path, 0)
    r1 = _rank(path, 1)
    _one_allreduce(r1)
    r1.negotiate_start("allreduce.left_open", "allreduce")
    r1.close()
    _one_allreduce(r0)
    r0.close()
    events = _events(path)
    assert _phases(events, 1)[:4] == _phases(events, 0)
    assert _phases(events, 1)[4:] == [("allreduce.left_open", "B", "NEGOTIATE_ALLREDUCE"),
                                      ("allreduce.left_open", "E", "")]  # closed at stop
    assert {e["args"]["name"] for e in events if e.get("name") == "process_name"} == \
        {"rank 0", "rank 1"}
    assert tl.END not in path.read_text()
    shift = r1.epoch_us - r0.epoch_us
    first1 = min(e["ts"] for e in _events(f"{path}.rank1") if "ts" in e)
    assert min(e["ts"] for e in events if e.get("pid") == 1 and "ts" in e) == \
        pytest.approx(first1 + shift, abs=0.01)


def test_merge_takes_only_this_jobs_session_and_waits_for_open_parts(tmp_path, monkeypatch):
    path = tmp_path / "timeline.json"
    old = _rank(path, 1, token=99)  # another job's part, closed
    _one_allreduce(old)
    old.close()
    monkeypatch.setenv(tl.ENV_WAIT, "30")
    r0 = _rank(path, 0)
    r0.close()  # another token: not merged, and not waited for
    assert {e["pid"] for e in _events(path)} == {0}

    r0, r1 = _rank(path, 0, session=2), _rank(path, 1, session=2)
    closing = threading.Thread(target=r0.close)
    closing.start()  # rank 0 waits for rank 1's part to end
    _one_allreduce(r1, "allreduce.late")
    r1.close()
    closing.join(60)
    assert not closing.is_alive()
    assert ("allreduce.late", "B", "ALLREDUCE") in _phases(_events(path), 1)

    monkeypatch.setenv(tl.ENV_WAIT, "0.2")
    r0, r1 = _rank(path, 0, session=3), _rank(path, 1, session=3)
    _one_allreduce(r1, "allreduce.unclosed")
    r0.close()  # rank 1 never closes: merged as it stands after the wait
    events = _events(path)
    head = [e for e in events if e.get("name") == "process_name" and e["pid"] == 1][0]
    assert head["args"]["dtrun"]["complete"] is False
    assert ("allreduce.unclosed", "E", "") in _phases(events, 1)
    r1.close()


def test_hooks_from_many_threads_keep_the_file_valid(tmp_path):
    ring = np.zeros(256, np.int64)

    class Recorder:  # the flight recorder's ring: sequence words at even slots
        def __init__(self):
            self.ring = memoryview(ring)

    t = tl.Timeline(str(tmp_path / "t.json"), 0, 1, True, 1, 1, Recorder())

    def work(k):
        for i in range(100):
            _one_allreduce(t, f"allreduce.t{k}.{i}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    t.op_start("allreduce.recorded", "allreduce")
    ring[0::2][:3] = [1, 2, 3]  # the collective made recorder entries 1 to 3
    t.op_end("allreduce.recorded", "allreduce", 4)
    t.close()
    events = _events(tmp_path / "t.json")
    phases = _phases(events)
    assert len(phases) == 4 * 100 * 4 + 2
    assert sum(p[1] == "B" for p in phases) == sum(p[1] == "E" for p in phases)
    assert sum(e.get("name") == "CYCLE_START" for e in events) == 400
    assert events[-1]["args"] == {"bytes": 4, "recorder": [1, 3]}


def test_categories_are_horovods():
    assert [tl.category(k) for k in ("allreduce", "grouped_allreduce", "allgather", "broadcast",
                                      "broadcast_object", "alltoall", "reducescatter",
                                      "grouped_reducescatter", "barrier", "join")] == \
        ["ALLREDUCE", "ALLREDUCE", "ALLGATHER", "BROADCAST", "BROADCAST", "ALLTOALL",
         "REDUCESCATTER", "REDUCESCATTER", "BARRIER", "JOIN"]


# ----------------------------------------------------------------------------- real ranks
def _both_ranks(summary: dict, cycles: bool) -> None:
    assert summary["balanced"]
    for pid in ("0", "1"):
        rank = summary["ranks"][pid]
        assert [NAME, "NEGOTIATE_ALLREDUCE"] in rank["phases"], summary
        assert [NAME, "ALLREDUCE"] in rank["phases"], summary
        assert rank["epoch"]
        assert (rank["cycles"] > 0) == cycles, summary


@pytest.mark.mpi
def test_env_timeline_on_two_ranks(tmp_path):
    rank0 = results(_run(tmp_path, "env"), 2)[0]
    assert rank0["live"] is True  # rank 0's file showed the allreduce while running
    _both_ranks(rank0["file"], cycles=True)


@pytest.mark.mpi
def test_dynamic_timeline_on_two_ranks(tmp_path):
    rank0 = results(_run(tmp_path, "dynamic"), 2)[0]
    assert rank0["no_file_before"]
    _both_ranks(rank0["dyn1"], cycles=True)
    _both_ranks(rank0["dyn2"], cycles=False)
    for summary in (rank0["dyn1"], rank0["dyn2"]):  # before start_timeline: not recorded
        assert all("before_start" not in str(r["phases"]) for r in summary["ranks"].values())


def _run(out, mode: str):
    """The rank program in ``mode`` on 2 ranks of this machine."""
    return dtrun("-np", 2, "-H", "localhost:2", "--oversubscribe", sys.executable, CASES, out,
                 mode, timeout=180)
