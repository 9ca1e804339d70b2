"""The set-up that `make test` does by itself: system packages, and a root run that must not skip.

These run the real script and a real pytest session; nothing is installed by them.
"""
import os
import subprocess

from tests.dtrun_helpers import BIN, REPO, user_env


def test_system_packages_without_root_prints_the_one_command():
    """.ci/system-packages as a user who cannot install: the command to run, then success."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dtrun-pkgs-") as tmp:  # readable by the unprivileged user
        os.chmod(tmp, 0o755)
        script, packages = os.path.join(tmp, "system-packages"), os.path.join(tmp, "packages")
        with open(script, "w") as f:
            f.write((REPO / ".ci" / "system-packages").read_text())
        with open(packages, "w") as f:
            f.write("# test\nbash\ndtrun-no-such-package\n")
        for path in (script, packages):
            os.chmod(path, 0o644)
        argv = ["bash", script]
        if os.geteuid() == 0:
            argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + argv
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "missing dtrun-no-such-package;" in p.stdout
    assert "sudo apt-get install -y --no-install-recommends dtrun-no-such-package" in p.stdout
    assert "bash" not in p.stdout.split("missing ")[1].split(";")[0]  # installed ones are not listed


def test_one_package_list_has_what_the_tests_use():
    listed = {l.split("#")[0].strip() for l in (REPO / ".ci" / "packages").read_text().splitlines()} - {""}
    assert {"openssh-server", "iptables", "openmpi-bin", "mpich", "slurm-wlm", "munge",
            "libopenmpi-dev", "libmpich-dev"} <= listed
    assert "apt-get" not in (REPO / ".ci" / "run").read_text()  # .ci/run goes through make test


def test_a_root_run_fails_when_a_multi_host_test_skips(tmp_path):
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n@pytest.mark.cluster\ndef test_needs_hosts():\n    pytest.skip('no sshd here')\n")
    argv = [str(BIN / "python"), "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
            "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path / "test_skips.py")]
    env = user_env(PYTHONPATH=str(REPO))
    env.pop("DTRUN_ALLOW_SKIPS", None)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    if os.geteuid() == 0:
        assert p.returncode == 1, p.stdout
        assert "1 multi-host or MPI-flavor test(s) skipped in a run as root" in p.stdout
        assert "test_needs_hosts (cluster): Skipped: no sshd here" in p.stdout
    else:
        assert p.returncode == 0, p.stdout
    allowed = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO,
                             env={**env, "DTRUN_ALLOW_SKIPS": "1"})
    assert allowed.returncode == 0, allowed.stdout
