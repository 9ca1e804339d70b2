"""dtrun doctor and keyscan as users call them: options, usage errors, a run on this host alone."""
import json

import pytest
from typer.testing import CliRunner

from dtrun.launcher.cli import sub_app
from tests.dtrun_helpers import dtrun, one_line_error


def test_doctor_and_keyscan_help():
    r = CliRunner().invoke(sub_app, ["doctor", "--help"])
    assert r.exit_code == 0
    for opt in ("--hostfile", "--cluster", "--ssh-config", "--timeout", "--json", "--all-pairs", "--program",
                "--no-e2e", "--include", "--exclude"):
        assert opt in r.output, opt
    r = CliRunner().invoke(sub_app, ["keyscan", "--help"])
    assert r.exit_code == 0 and "--yes" in r.output and "--ssh-config" in r.output


def test_doctor_usage_errors_exit_2():
    one_line_error(dtrun("doctor", "-H", "localhost", "--timeout", "0"), "--timeout must be positive")
    one_line_error(dtrun("doctor", "-H", "localhost", "--program", "/nonexistent/train.py"),
                   "--program /nonexistent/train.py: no such file")
    one_line_error(dtrun("doctor", "-H", "a:x"), "slots for a must be a positive integer")
    one_line_error(dtrun("doctor", "-H", "node1", "--ssh-config", "/nonexistent/cfg"), "ssh config /nonexistent/cfg")
    one_line_error(dtrun("doctor", "--bogus"), "no such option --bogus")


def test_keyscan_usage_errors_exit_2():
    one_line_error(dtrun("keyscan"), "no hosts given")
    one_line_error(dtrun("keyscan", "-H", "a", "b"), "not both")


@pytest.mark.mpi
def test_doctor_on_this_host_alone(tmp_path):
    """Its end-to-end phase starts a real mpirun job (the ``mpi`` mark)."""
    prog = tmp_path / "train.py"
    prog.write_text("print(1)\n")
    p = dtrun("doctor", "-H", "localhost:2", "--json", "--program", prog, timeout=60)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["hosts"] == ["localhost"] and data["exit_code"] == 0
    assert data["summary"]["localhost"] == {"ssh": "na", "env": "ok", "network": "na", "firewall": "na",
                                            "gpu": "na", "e2e": "ok"}
    assert data["recommendation"] is None
    lo = next(i for i in data["interfaces"]["localhost"] if i["name"] == "lo")
    assert lo == {"name": "lo", "up": True, "mtu": 65536, "addrs": ["127.0.0.1/8"]}
