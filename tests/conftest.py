"""Project-wide test hooks.

A fresh machine set up by ``make test`` as root has everything the multi-host and
other-MPI tests need, so there a skip of one of them is a set-up defect, not a pass:
the session fails and names it. ``DTRUN_ALLOW_SKIPS=1`` lets such a run pass anyway
(for a root shell on a machine that deliberately lacks them). Without root, these tests
skip with their reason and the run passes.
"""
import os
import shutil
import subprocess

import pytest

from tests.dtrun_helpers import AS_OTHER_USER, OTHER_UID

pytest_plugins = ["tests.cluster_plugin"]

# Marks of the tests that a root run must not skip.
MUST_RUN_AS_ROOT = ("cluster", "flavor")
_must_not_skip: list = []


def skips_fail_the_run() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0 and os.environ.get("DTRUN_ALLOW_SKIPS") != "1"


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail") and skips_fail_the_run():
        marks = [m for m in MUST_RUN_AS_ROOT if m in report.keywords]
        if marks:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            _must_not_skip.append(f"{report.nodeid} ({marks[0]}): {reason}")


def pytest_sessionfinish(session, exitstatus):
    if not _must_not_skip:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(_must_not_skip)} multi-host or MPI-flavor test(s) skipped in a run as root; "
             "`make test` installs what they need (or set DTRUN_ALLOW_SKIPS=1):"] + _must_not_skip
    if reporter is not None:
        for line in lines:
            reporter.write_line(line, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def other_user():
    """``other_user(*cmd)`` runs a command as the tests' second local user (uid OTHER_UID),
    created here if missing; needs root and setpriv."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as a second user")
    subprocess.run(f"id dtother >/dev/null 2>&1 || useradd -u {OTHER_UID} -M -N dtother",
                   shell=True, check=True)

    def run(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([*AS_OTHER_USER, *cmd], capture_output=True, text=True, timeout=120)
    return run
