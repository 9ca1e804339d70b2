"""pytest fixtures for network-namespace clusters (see tests/nscluster/).

Loaded by the project's conftest with ``pytest_plugins = ["tests.cluster_plugin"]``.

* ``make_cluster(n, faults=..., cluster_faults=...)``: an up Cluster, torn down when the
  test ends. Use it whenever a test needs faults.
* ``cluster3``: one healthy 3-host cluster shared by the whole session. Tests must leave
  it healthy (no add_fault on it).

Where namespaces cannot be made (not root, no ``ip netns``, no sshd) the fixtures skip
with the reason. After the session, anything left by a cluster of this run is reported,
removed, and fails the run.
"""

from __future__ import annotations

import signal
from typing import Callable, Iterator

import pytest

from tests import nscluster
from tests.nscluster import Cluster

_SKIP_PREFIX = "network-namespace cluster unavailable: "


def skip_if_unavailable() -> None:
    """pytest.skip with the reason when this machine cannot host a namespace cluster."""
    reason = nscluster.cluster_unavailable_reason()
    if reason:
        pytest.skip(_SKIP_PREFIX + reason)


def _terminate_gracefully() -> None:
    """Turn SIGTERM into KeyboardInterrupt so pytest unwinds and finalizers tear down."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def handler(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")
        signal.signal(signal.SIGTERM, handler)


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    """Factory: ``make_cluster(n, faults=None, cluster_faults=frozenset(), prefix=None)``."""
    skip_if_unavailable()
    _terminate_gracefully()
    made: list[Cluster] = []

    def factory(n: int, **kwargs) -> Cluster:
        cluster = Cluster(n, **kwargs)
        made.append(cluster)
        return cluster.up()

    yield factory
    errors = []
    for cluster in reversed(made):
        try:
            cluster.down()
        except nscluster.ClusterError as exc:
            errors.append(str(exc))
    if errors:
        pytest.fail("; ".join(errors))


@pytest.fixture(scope="session")
def cluster3() -> Iterator[Cluster]:
    """A healthy 3-host cluster shared by the session (do not add faults to it)."""
    skip_if_unavailable()
    _terminate_gracefully()
    cluster = Cluster(3).up()
    try:
        yield cluster
    finally:
        cluster.down()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every cluster of this run must be gone: report, clean up and fail otherwise."""
    left = []
    for prefix in dict.fromkeys(nscluster.CREATED_PREFIXES):
        found = nscluster.leftovers(prefix)
        if found:
            left += found
            nscluster.down_prefix(prefix)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "namespace clusters left behind: " + "; ".join(left)
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
