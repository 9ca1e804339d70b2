"""Which allreduce path (and shared-memory chunk) to take for each size: the path selector.

Why measure instead of fixing a threshold: the shared-memory path wins by 1.5-4x while
the data fits in cache and both ranks are on-CPU, and can lose to MPI when it does not,
with crossovers that move with the host (cache sizes, core count, the MPI build). So a
``Comm`` measures the candidates once per host layout and MPI, at creation:

* candidates: ``mpi`` (MPI_Allreduce: whatever the library picks), ``shm1`` and ``shm2``
  (the compiled engine, one host), ``shm`` with each chunk of ``CHUNKS`` (one host; not
  timed beside the engine: see ``timed``),
  ``shm+hierarchical`` (shm within hosts, MPI_Allreduce between), ``shm+ring`` (shm
  within hosts, a ring between), ``ring`` (a flat ring over all ranks) — each only
  where it applies;
* sizes: ``BUCKETS`` (256 B to 16 MiB, factor 4), out of place and in place; a size
  takes the decision of the largest bucket not above it (below 256 B the 256 B one).
  Across hosts from 64 KiB only (smaller sizes are latency-bound: MPI), two timed
  rounds each. Larger sizes are skipped once their predicted cost (1.5x the previous
  size's timed rounds up to 256 KiB, 4x above) would overrun the time budget (1 s on
  one host, 4 s across hosts), and take the largest measured size's decision;
* each candidate is timed in alternating rounds (a round lasts 0.2 ms, 1 ms from
  256 KiB), each rank keeps its median round, the slowest rank's time counts (an
  allreduce is as slow as its slowest rank). Medians, not best rounds: a path whose
  time varies a lot wins on its best round and loses in a job's loop;
* rank 0 decides (fastest candidate; MPI on a tie: another path must take under 97 % of
  MPI's time, under 80 % across hosts, where calls over the network vary far more) and
  broadcasts the table, so every rank takes the same path for the same size, as it
  must (else the ranks deadlock).

The table is cached (``$XDG_CACHE_HOME/dtrun/collectives-tuning.json``) under a key of
the hosts, the MPI library, the layout (ranks per host, hosts) and this module's
version; rank 0 reads it and broadcasts it, so a later job on the same hosts pays one
file read. A cache entry that does not parse or does not fit is discarded and measured
again. Calibration takes 0.3-1 s on an idle 2-core host (more when it is busy).

Overrides, strongest first (the same on every rank: set them with `-x NAME=VALUE`; on one host the ranks also inherit dtrun's environment):
``DTRUN_SHM=0`` (no shared-memory candidates), ``DTRUN_ALLREDUCE_PATH=<path>`` (that
path at every size), an explicit ``shm_threshold``/``shm_chunk`` or
``DTRUN_SHM_THRESHOLD``/``DTRUN_SHM_CHUNK`` (the fixed rule: shm at or above the
threshold, with that chunk), ``DTRUN_TUNE=0`` (the fixed rule with the built-in
defaults), ``DTRUN_TUNE=refresh`` (measure again and rewrite the cache entry). A measurement taken while the load average
exceeds ``DTRUN_TUNE_MAX_LOAD`` (default 3) times the cores is used but not cached.
"""

from __future__ import annotations

import json
import os
import time
from bisect import bisect_right
from typing import Callable

import numpy as np

from . import cache
from ._mpi import MPI

VERSION = 9
PATHS = ("mpi", "shm1", "shm2", "shm", "shm+hierarchical", "shm+ring", "ring", "stream")
BUCKETS = tuple(256 * 4 ** i for i in range(9))  # 256 B .. 16 MiB
CHUNKS = (128 << 10, 512 << 10, 2 << 20)
ROUNDS = 5          # timed rounds per candidate (plus one untimed warm-up round) ...
ROUNDS_SMALL = 5    # ... and up to 64 KiB, where rounds are cheap and noise is relatively large
ROUND_MIN_S = 200e-6  # a timed round repeats the call until it lasts about this long ...
ROUND_MIN_S_LARGE = 1e-3  # ... and from 256 KiB, where one call takes 20-300 us
MARGIN = 0.97       # another path must take under 97 % of MPI's time: on a tie, MPI
HOSTS_MARGIN = 0.8  # across hosts, under 80 %: there a round is one call over a network
                    # whose timings vary by 2x between calls, so a 1.1x "win" is noise
HOSTS_ROUNDS = 2    # timed rounds per candidate across hosts
BUDGET_S = 1.0      # past this, larger sizes take the decision of the largest measured
HOSTS_BUDGET_S = 4.0  # the same across hosts (slower networks, more candidates)
STREAM_FROM = 4 << 20  # across hosts, the streaming ring is timed from here (see decide)
HOSTS_FIRST = 4     # across hosts, sizes below BUCKETS[4] = 64 KiB are latency-bound: MPI
SHM1_MAX = 1 << 20  # shm1 is timed below this size only (see applies)
NOT_MEASURED, EXTRAPOLATED = -2.0, -1.0  # markers in place of times
CACHE_FILE = "collectives-tuning.json"
CACHE_ENTRIES = 32  # newest kept
OVERLOAD = 3.0      # load average per core above which a measurement is not cached


def max_load() -> float:
    """``DTRUN_TUNE_MAX_LOAD`` (load average per core above which a measurement is not cached;
    a negative value: never cached).

    Raises:
        ValueError: it is set to something other than a finite number (the message names it).
    """
    raw = os.environ.get("DTRUN_TUNE_MAX_LOAD", "").strip()
    if not raw:
        return OVERLOAD
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"DTRUN_TUNE_MAX_LOAD={raw!r}: give a load average per core (e.g. 3; negative: never cache)")
    return value


def _mib(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):g} MiB"
    return f"{n / 1024:g} KiB" if n >= 1024 else f"{n} B"


class Table:
    """The decision per size: ``pick(nbytes, inplace) -> (path, chunk)``, and why.

    ``rows[inplace][i]`` is ``(path, chunk, t_path, t_mpi)`` for ``BUCKETS[i]`` (times in
    seconds, 0 when not measured). ``floor`` is the smallest size that can leave MPI: the
    allreduce hot path tests only that for small messages.
    """

    def __init__(self, rows: list[list[tuple]], source: str, rule: str = "") -> None:
        self.rows = rows
        self.source = source  # "calibrated on …", "env DTRUN_SHM_THRESHOLD=…", …
        self.rule = rule
        # Bucket i covers [BUCKETS[i], BUCKETS[i + 1]): a size between two measured sizes
        # takes the smaller one's decision. At the low crossover that keeps MPI (the
        # shared-memory path's advantage grows with size there): nearest-on-a-log-scale
        # sent 8 KiB to the 16 KiB decision and lost 0.6x.
        self._bounds = list(BUCKETS[1:])
        floor = 1 << 62
        for variant in rows:
            for i, row in enumerate(variant):
                if row[0] != "mpi":
                    floor = min(floor, 0 if i == 0 else BUCKETS[i])
        self.floor = floor

    @classmethod
    def fixed(cls, path: str, threshold: int, chunk: int, source: str) -> "Table":
        """``path`` at or above ``threshold`` bytes, MPI below (no measurement)."""
        t = cls([[("mpi", 0, 0.0, 0.0)] * len(BUCKETS) for _ in range(2)], source,
                rule=f"{path} at or above {_mib(threshold)}, chunk {_mib(chunk)}; mpi below")
        t._fixed = (path, chunk)
        t.floor = threshold if path != "mpi" else 1 << 62
        return t

    def compiled_rows(self, inplace: bool) -> tuple[tuple[int, int], ...]:
        """The leading sizes that take a compiled path, as the engine's own table: rows of
        (bound, code), sizes below ``bound`` and at or above the row before take code 1
        (shm1) or 2 (shm2); from the first size that takes another path on, none."""
        code = {"shm1": 1, "shm2": 2}
        fixed = getattr(self, "_fixed", None)
        if fixed is not None:
            return ((1 << 62, code[fixed[0]]),) if fixed[0] in code and self.floor == 0 else ()
        out: list[tuple[int, int]] = []
        for i, r in enumerate(self.rows[1 if inplace else 0]):
            if r[0] not in code:
                break
            bound = BUCKETS[i + 1] if i + 1 < len(BUCKETS) else 1 << 62
            if out and out[-1][1] == code[r[0]]:
                out[-1] = (bound, code[r[0]])
            else:
                out.append((bound, code[r[0]]))
        return tuple(out)

    def pick(self, nbytes: int, inplace: bool) -> tuple[str, int]:
        if nbytes < self.floor:
            return "mpi", 0
        fixed = getattr(self, "_fixed", None)
        if fixed is not None:
            return fixed
        row = self.rows[1 if inplace else 0][bisect_right(self._bounds, nbytes)]
        return row[0], row[1]

    def explain(self, nbytes: int, inplace: bool = False) -> str:
        path, chunk = self.pick(nbytes, inplace)
        what = path if path in ("mpi", "shm1", "shm2") or not path.startswith("shm") else \
            f"{path} (chunk {_mib(chunk)})"
        if self.rule:
            return f"{what}: {self.source}: {self.rule}"
        i = bisect_right(self._bounds, nbytes)
        _, _, t, t_mpi = self.rows[1 if inplace else 0][i]
        place = "in place" if inplace else "out of place"
        if t == NOT_MEASURED:
            return (f"{what}: {self.source}: across hosts sizes below {_mib(BUCKETS[HOSTS_FIRST])}"
                    " are latency-bound and not measured")
        if t < 0:
            j = max(k for k in range(i) if self.rows[1 if inplace else 0][k][2] != EXTRAPOLATED)
            twin = "" if self.rows[1 if inplace else 0][j][0] == path else \
                " (stream from 4 MiB)" if path == "stream" else " (shm2 for shm1 from 1 MiB)"
            return (f"{what}: {self.source}: not measured at {_mib(BUCKETS[i])} (calibration "
                    f"time budget); as at {_mib(BUCKETS[j])} {place}{twin}")
        if path == "mpi":
            how = "mpi was fastest"
        else:
            how = f"{path} {t_mpi / t:.2f}x mpi" if t > 0 and t_mpi > 0 else path
        return f"{what}: {self.source}: {how} at {_mib(BUCKETS[i])} {place}"


def candidates(shm: bool, nnodes: int, uniform: bool, local_size: int,
               compiled: bool = False) -> list[tuple[str, int]]:
    """(path, chunk) pairs that apply to this layout (``compiled``: the shm1 engine is
    there; its chunk is its own, recorded as 0)."""
    out: list[tuple[str, int]] = [("mpi", 0)]
    shm_ok = shm and local_size > 1 and (nnodes == 1 or uniform)
    if nnodes == 1:
        if shm_ok and compiled:
            out += [("shm1", 0), ("shm2", 0)]
        if shm_ok:
            out += [("shm", c) for c in CHUNKS]
        return out
    if shm_ok:
        # Across hosts the network dominates: one chunk size keeps calibration short.
        out += [("shm+hierarchical", CHUNKS[1]), ("shm+ring", CHUNKS[1])]
    out += [("ring", 0), ("stream", 0)]
    return out


def timed(cands: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The candidates a calibration times. Beside the compiled engine the Python ``shm``
    path is not one (it stays a path to force): it moves the same bytes with cached
    stores only, so a calibration that met the ranks' cores in one cache domain could take
    it, and it then lost 2x when they ran apart (_fastshm.c)."""
    if any(path in ("shm1", "shm2") for path, _ in cands):
        return [c for c in cands if c[0] != "shm"]
    return list(cands)


def applies(cand: tuple[str, int], nbytes: int) -> bool:
    """A chunk matters only below the size: of the chunks >= the size, time the smallest.
    ``shm1`` is not timed from ``SHM1_MAX`` up: what it saves is one synchronisation per
    step, nothing next to such a call, and it moves more bytes than ``shm2`` (each rank
    reduces every slot, its own read back included), so there it could win a calibration
    only by noise, and then lose in the job. ``stream`` is timed from ``STREAM_FROM`` up:
    below, its TCP ring has too little to stream."""
    path, chunk = cand
    if path == "shm1":
        return nbytes < SHM1_MAX
    if path == "stream":
        return nbytes >= STREAM_FROM
    if chunk == 0:
        return True
    bigger = [c for c in CHUNKS if c >= nbytes]
    return chunk < nbytes or (bool(bigger) and chunk == min(bigger))


def measure(mpi: MPI.Intracomm, cands: list[tuple[str, int]],
            run: Callable[[tuple[str, int], np.ndarray, np.ndarray, bool], None],
            first: int = 0, rounds: tuple[int, int] = (ROUNDS_SMALL, ROUNDS),
            budget: float = BUDGET_S, tick: Callable[[int], None] | None = None) -> np.ndarray:
    """Seconds per call, shape (len(BUCKETS), 2 [out of place, in place], len(cands)):
    each rank's median round, then the maximum over ranks (inf: not applicable).

    Buckets below ``first`` are not measured (MPI's time is ``NOT_MEASURED``); buckets
    whose predicted cost (from the previous bucket's timed rounds) would overrun
    ``budget`` are not either (``EXTRAPOLATED``: they take the decision of the largest
    measured size). ``rounds``: timed rounds up to 64 KiB, and above. ``tick(nbytes)``
    after each size measured: the job's progress (a hang watch sees calibration as work).
    """
    med = np.full((len(BUCKETS), 2, len(cands)), np.inf)
    med[:first, :, 0] = NOT_MEASURED
    start = time.perf_counter()
    spent = np.zeros(2)  # wall time so far, and the last bucket's timed rounds
    for si in range(first, len(BUCKETS)):
        nbytes = BUCKETS[si]
        spent[0] = time.perf_counter() - start
        mpi.Allreduce(MPI.IN_PLACE, spent, op=MPI.MAX)  # every rank stops at the same size
        # The next size's cost, from the last one's timed rounds (warm-up rounds pay for
        # set-up and first touches once): 4x where bandwidth-bound, 1.5x below 256 KiB.
        grow = 4 if nbytes > 256 << 10 else 1.5
        if si > first and spent[0] + grow * spent[1] > budget:
            med[si:, :, 0] = EXTRAPOLATED
            break
        med[si], spent[1] = _measure_size(mpi, cands, run, nbytes,
                                          rounds[0] if nbytes <= 64 << 10 else rounds[1])
        if tick is not None:
            tick(nbytes)
    mpi.Allreduce(MPI.IN_PLACE, med, op=MPI.MAX)
    return med


def _measure_size(mpi: MPI.Intracomm, cands: list[tuple[str, int]], run, nbytes: int,
                  nrounds: int) -> tuple[np.ndarray, float]:
    """This rank's median seconds per call at ``nbytes``, shape (2, len(cands)), and the
    seconds its timed rounds took. Candidates alternate within each round, in the reverse
    order every other round; a round repeats the call for ``round_s(nbytes)``: the median
    of such rounds is what a job that calls it in a loop sees (best rounds favour the
    paths whose time varies most)."""
    x = np.empty(nbytes // 4, dtype=np.float32)
    x.fill(0)  # written, so out of place reads real pages (zeros: sums stay finite)
    y = np.zeros_like(x)
    y.fill(0)
    iters = np.ones((2, len(cands)), dtype=np.int64)
    times: list[list[list[float]]] = [[[] for _ in cands] for _ in (0, 1)]
    order = [(ci, ip) for ci, cand in enumerate(cands) if applies(cand, nbytes) for ip in (0, 1)]
    timed = 0.0
    for rnd in range(nrounds + 1):
        for ci, ip in (order if rnd % 2 == 0 else order[::-1]):
            n = int(iters[ip, ci])
            mpi.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                run(cands[ci], y if ip else x, y, bool(ip))
            took = time.perf_counter() - t0
            if rnd == 0:
                # Warm-up round: size the timed rounds (same count on all ranks).
                iters[ip, ci] = max(1, min(200, int(round_s(nbytes) / max(took / n, 1e-7))))
            else:
                times[ip][ci].append(took / n)
                timed += took
        if rnd == 0:
            mpi.Allreduce(MPI.IN_PLACE, iters, op=MPI.MAX)
    out = np.full((2, len(cands)), np.inf)
    for ci, ip in order:
        out[ip, ci] = float(np.median(times[ip][ci]))
    return out, timed


def round_s(nbytes: int) -> float:
    """How long a timed round lasts: long enough to hold several calls from 256 KiB up
    (one or two calls per round let a scheduler tick decide), short below."""
    return ROUND_MIN_S if nbytes < 256 << 10 else ROUND_MIN_S_LARGE


def decide(times: np.ndarray, cands: list[tuple[str, int]],
           margin: float = MARGIN) -> list[list[tuple]]:
    """rows[inplace][bucket] = (path, chunk, t_path, t_mpi): the fastest, MPI on a tie
    (another path must take under ``margin`` times MPI's time: measurement noise must not
    pick a loser).

    The streaming ring between hosts (``stream``) needs only to match MPI, and it takes
    the sizes from ``STREAM_FROM`` up that the time budget left unmeasured. Where the
    budget runs out that early, the link is slow and sets the pace; there it has matched
    MPI on 2 hosts and beaten it on 3, and on 2 hosts of 2 ranks (``make bench``). On a
    fast link its own measurement decides: there MPI can be 1.6x faster on 2 hosts."""
    stream = ("stream", 0) in cands
    rows: list[list[tuple]] = [[], []]
    for ip in (0, 1):
        for si in range(len(BUCKETS)):
            t = times[si, ip].copy()
            if t[0] == NOT_MEASURED:
                rows[ip].append(("mpi", 0, NOT_MEASURED, NOT_MEASURED))
                continue
            if t[0] < 0:  # not measured (calibration budget): as the size below
                below = rows[ip][-1][:2]
                if below[0] == "shm1" and BUCKETS[si] >= SHM1_MAX:
                    below = ("shm2", 0)  # its twin from there up (see applies)
                if stream and BUCKETS[si] >= STREAM_FROM:
                    below = ("stream", 0)
                rows[ip].append(below + (EXTRAPOLATED, EXTRAPOLATED))
                continue
            # The fastest of the paths under their margin of MPI's time, else MPI.
            fast = [k for k in range(1, len(t)) if (t[k] <= t[0] if cands[k][0] == "stream"
                                                    else t[k] < margin * t[0])]
            k = min(fast, key=lambda k: t[k]) if fast else 0
            path, chunk = cands[k]
            rows[ip].append((path, int(chunk), float(t[k]), float(t[0])))
    return rows


def _valid_rows(rows, cands: list[tuple[str, int]]) -> bool:
    allowed = {(p, c) for p, c in cands}
    try:
        if len(rows) != 2 or any(len(v) != len(BUCKETS) for v in rows):
            return False
        for v in rows:
            for path, chunk, t, t_mpi in v:
                if (path, chunk) not in allowed or \
                        not (t >= 0 or t == t_mpi in (NOT_MEASURED, EXTRAPOLATED)):
                    return False
        return True
    except (TypeError, ValueError):
        return False


def _bcast_json(mpi: MPI.Intracomm, doc) -> object:
    """Rank 0's JSON-able ``doc`` on every rank (buffer calls: length, then bytes)."""
    data = json.dumps(doc).encode() if mpi.Get_rank() == 0 else b""
    n = np.array([len(data)], dtype=np.int64)
    mpi.Bcast(n, root=0)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if mpi.Get_rank() == 0 else \
        np.empty(int(n[0]), dtype=np.uint8)
    mpi.Bcast(buf, root=0)
    return json.loads(buf.tobytes().decode())


def _hosts(mpi: MPI.Intracomm, host: str) -> list[str]:
    """Every rank's host name, on every rank (fixed-width buffers, no pickling)."""
    width = 256
    mine = np.zeros(width, dtype=np.uint8)
    raw = host.encode()[:width]
    mine[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    table = np.empty((mpi.Get_size(), width), dtype=np.uint8)
    mpi.Allgather(mine, table)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table]


def cache_key(hosts: list[str], local_size: int, nnodes: int, cands) -> str:
    mpi = MPI.Get_library_version().splitlines()[0].strip()[:80]
    names = ",".join(sorted(set(hosts)))
    kinds = ",".join(sorted({p for p, _ in cands}))
    return (f"v{VERSION}|{names}|{mpi}|ranks {len(hosts)} x{local_size}/host "
            f"{nnodes} host(s)|{kinds}|numpy {np.__version__}")


def calibrated(mpi: MPI.Intracomm, host: str, local_size: int, nnodes: int,
               cands: list[tuple[str, int]], run, refresh: bool = False,
               tick: Callable[[int], None] | None = None) -> Table:
    """The measured table for this layout: from the cache, or measured now (collective)."""
    hosts = _hosts(mpi, host)
    key = cache_key(hosts, local_size, nnodes, cands)
    path = cache.cache_dir() / CACHE_FILE
    entry = None
    if mpi.Get_rank() == 0 and not refresh:
        found = cache.load(path).get(key)
        if isinstance(found, dict) and _valid_rows(found.get("rows"), cands) \
                and isinstance(found.get("when"), str):
            entry = found
    entry = _bcast_json(mpi, entry)
    if entry is not None:
        rows = [[tuple(r) for r in v] for v in entry["rows"]]
        return Table(rows, f"calibrated on {hosts[0]}/{_mpi_name()} at {entry['when']} "
                           f"(cached, took {entry.get('took_s', 0):.2f} s)")
    load0 = _load()
    t0 = time.perf_counter()
    if nnodes > 1:
        times = measure(mpi, cands, run, first=HOSTS_FIRST,
                        rounds=(HOSTS_ROUNDS, HOSTS_ROUNDS), budget=HOSTS_BUDGET_S, tick=tick)
    else:
        times = measure(mpi, cands, run, tick=tick)
    took = time.perf_counter() - t0
    entry = None
    if mpi.Get_rank() == 0:
        load = max(load0, _load())
        entry = {"rows": decide(times, cands, HOSTS_MARGIN if nnodes > 1 else MARGIN),
                 "took_s": round(took, 3),
                 "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load": round(load, 2)}
        # On a host loaded far beyond its cores the timings say more about the other jobs
        # than about the paths: use them for this communicator, keep them out of the cache.
        limit = max_load()
        busy = load > limit * (os.cpu_count() or 1)
        entry["note"] = f"; not cached: load {load:.1f} on {os.cpu_count()} cores" if busy else ""
        # With a core per rank on one host, a budget spent before 1 MiB means every call
        # was slow (the ranks shared their cores with a burst of other work): the table's
        # large sizes would all take a small size's decision. Used now, measured again
        # next time. (More ranks than cores are always that slow: cached as measured.)
        cut = next((BUCKETS[i] for i in range(len(BUCKETS)) if times[i, 0, 0] == EXTRAPOLATED), None)
        if not busy and nnodes == 1 and local_size <= (os.cpu_count() or 1) \
                and cut is not None and cut <= 1 << 20:
            busy = True
            entry["note"] = f"; not cached: the time budget ran out before {_mib(cut)}"
        if not busy:
            doc = cache.load(path)
            doc[key] = entry
            while len(doc) > CACHE_ENTRIES:  # drop the oldest entries
                doc.pop(min(doc, key=lambda k: str(doc[k].get("when", "")) if
                            isinstance(doc[k], dict) else ""))
            cache.save(path, doc)
    entry = _bcast_json(mpi, entry)
    rows = [[tuple(r) for r in v] for v in entry["rows"]]
    return Table(rows, f"calibrated on {hosts[0]}/{_mpi_name()} at {entry['when']} "
                       f"(now, took {entry['took_s']:.2f} s{entry['note']})")


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def _mpi_name() -> str:
    v = MPI.Get_library_version().split(",")[0].strip()
    return v or "MPI"
