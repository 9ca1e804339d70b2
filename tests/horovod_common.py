"""What the Horovod tests share, for both frameworks (imports neither): the rank programs'
data, expected reductions and comparison (tests/horovod_*_cases.py import it by its bare
name: a script's own folder is on its path), and the drivers' reading of their results
(tests/test_horovod_*.py)."""

from __future__ import annotations

import sys

import numpy as np

from dtrun.collectives.horovod._core import Average, HorovodUnsupportedError, Max, Min, Product, Sum

TOL = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-6, "float64": 1e-12}


def data(r: int, rows: int = 4) -> np.ndarray:
    """Rank r's values (small positive integers: exact in every dtype, even products)."""
    return (((np.arange(rows * 3) + 5 * r) % 3) + 1).reshape(rows, 3).astype(np.float64)


def reduced(op: str, dtype: str, n: int, rows: int = 4) -> np.ndarray:
    """The reduction ``op`` of ``data`` over ranks 0..n-1, as Horovod computes it in
    ``dtype`` (an integer average truncates)."""
    stack = np.stack([data(r, rows) for r in range(n)])
    if op == Sum:
        return stack.sum(0)
    if op == Average:
        s = stack.sum(0) / n
        return np.trunc(s) if dtype.startswith(("int", "uint")) else s
    return {Min: stack.min(0), Max: stack.max(0), Product: stack.prod(0)}[op]


def compare(failures: list[str], what: str, got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    """Add a line to ``failures`` when ``got`` (float64) differs from ``want`` beyond
    ``dtype``'s tolerance (exact for integers)."""
    if got.shape != want.shape:
        failures.append(f"{what} {dtype}: shape {got.shape} != {want.shape}")
    elif not np.allclose(got, want, rtol=TOL.get(dtype, 0), atol=0):
        failures.append(f"{what} {dtype}: {got.ravel()[:6]} != {want.ravel()[:6]}")


def unsupported_messages(calls) -> dict:
    """Each (name, call)'s HorovodUnsupportedError message, by name (None where the call
    raised nothing)."""
    out = {}
    for name, call in calls:
        try:
            call()
            out[name] = None
        except HorovodUnsupportedError as e:
            out[name] = str(e)
    return out


def results(proc, n: int) -> list[dict]:
    """The ``RESULT {json}`` line of each of ``n`` ranks, in rank order (the job must exit 0)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from tests.dtrun_helpers import result_records  # the drivers' side only: ranks import this file by its bare name

    found = result_records(proc.stdout)
    assert len(found) == n, proc.stdout[-3000:]
    return sorted(found, key=lambda r: r["rank"])


ADASUM = ("Adasum: not provided by collectives.horovod; use op=Average (the default) or "
          "op=Sum")


def mismatch(rank: int, n: int) -> str:
    """The error every rank reports when the last rank passes shape (4,) and the others (3,)."""
    return (f"allreduce on rank {rank}: allreduce 'grads.w' has shape (4,) on rank {n - 1} "
            "but (3,) on rank 0")


def load_ranks(out, n: int) -> list[dict]:
    """Each rank's ``OUT/rank.R.npz``."""
    return [dict(np.load(out / f"rank.{r}.npz")) for r in range(n)]


def assert_trained_alike(ranks: list[dict], pairs: list[tuple[str, str]]) -> None:
    """For each (distributed, reference) pair of keys: close on rank 0, and the distributed
    arrays bit-identical on every rank."""
    for dist, ref in pairs:
        np.testing.assert_allclose(ranks[0][dist], ranks[0][ref], rtol=1e-5, atol=1e-5,
                                   err_msg=dist)
        for r in range(1, len(ranks)):
            assert ranks[r][dist].tobytes() == ranks[0][dist].tobytes(), (dist, r)


def run_on_localhost(cases: str, n: int, out, timeout: int):
    """``cases`` with ``n`` ranks on this machine."""
    from tests.dtrun_helpers import dtrun

    return dtrun("-np", n, "-H", f"localhost:{n}", "--oversubscribe", sys.executable, cases, out,
                 timeout=timeout)


def run_on_two_hosts(cluster, cases: str, out, timeout: int):
    """``cases`` with 2 ranks on each of the cluster's first two namespace hosts."""
    from tests.dtrun_helpers import dtrun

    names = [h.name for h in cluster.hosts[:2]]
    return dtrun("--ssh-config", cluster.ssh_config, "-H", f"{names[0]}:2,{names[1]}:2",
                 sys.executable, cases, out, timeout=timeout)


def driver_tests(cases: str, check, timeout: int, two_hosts_check=None):
    """The two tests of each framework's driver: ``cases`` on 1, 2 and 3 ranks of this
    machine, and on 2 namespace hosts x 2 ranks. ``check(found, out, n)`` reads every rank's
    results; ``two_hosts_check(found)``, where given, adds what only two hosts show.
    Returns (on_localhost, on_two_hosts): assign them to ``test_*`` names."""
    import pytest

    @pytest.mark.mpi
    @pytest.mark.parametrize("n", [1, 2, 3])
    def on_localhost(n, tmp_path):
        check(results(run_on_localhost(cases, n, tmp_path, timeout=timeout), n), tmp_path, n)

    @pytest.mark.cluster
    @pytest.mark.mpi
    def on_two_hosts(cluster3, tmp_path):
        found = results(run_on_two_hosts(cluster3, cases, tmp_path, timeout=timeout), 4)
        check(found, tmp_path, 4)
        if two_hosts_check is not None:
            two_hosts_check(found)

    return on_localhost, on_two_hosts


def example_line(example: str, prefix: str, *args, timeout: int) -> str:
    """Run ``examples/EXAMPLE`` on 2 ranks of this machine (it must exit 0) and return the one
    line of its output that starts with ``prefix`` (rank 0 alone prints it)."""
    from tests.dtrun_helpers import REPO, dtrun

    proc = dtrun("-np", 2, "-H", "localhost:2", "--oversubscribe", sys.executable,
                 str(REPO / "examples" / example), *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, proc.stdout[-2000:]
    return lines[0]


def raises(failures: list[str], what: str, kinds, call, *needles) -> None:
    """Add a line to ``failures`` unless ``call()`` raises one of ``kinds`` whose message
    holds every needle."""
    try:
        call()
    except kinds as e:
        missing = [n for n in needles if n not in str(e)]
        if missing:
            failures.append(f"{what}: {type(e).__name__}({str(e)[:300]}) lacks {missing}")
        return
    except Exception as e:  # noqa: BLE001 — the wrong type is the finding
        failures.append(f"{what}: raised {type(e).__name__}({str(e)[:300]}), not {kinds}")
        return
    failures.append(f"{what}: raised nothing")


def compared(failures: list[str], what: str, got: np.ndarray, want, atol: float) -> None:
    """Add a line to ``failures`` unless ``got`` (float64) equals ``want`` to ``atol``."""
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or not np.allclose(got, want, rtol=0, atol=atol):
        failures.append(f"{what}: {got.ravel()[:6].tolist()} != {want.ravel()[:6].tolist()} "
                        f"(shapes {got.shape}, {want.shape})")

