"""Typed boundaries: the probe report parsed at the edge of checks/, --traceback read up front."""
import pytest

from dtrun.checks import env
from dtrun.checks.probereport import ProbeReportError, parse_probe_report
from dtrun.checks.result import FAIL
from dtrun.launcher import cli
from dtrun.launcher.errors import UsageError
from tests.test_checks_env import LOCAL, healthy


def test_a_malformed_probe_report_is_a_named_probe_failure_not_quiet_defaults():
    rep = healthy(python={"version": 3.11})
    [f] = env.env_findings("h2", rep, LOCAL)
    assert f.status == FAIL
    assert f.detail == "the probe failed on h2: malformed probe report: python.version is float, expected str"


@pytest.mark.parametrize("data, message", [
    ([], "the report is list, expected an object"),
    ({"env": {"PATH": ["/bin"]}}, "env.PATH is list, expected str"),
    ({"paths": {"cwd": "yes"}}, "paths.cwd is str, expected dict"),
    ({"stale_sessions": {"count": True}}, "stale_sessions.count is bool, expected int"),
    ({"port": "22"}, "port is str, expected int"),
])
def test_parse_names_the_field_of_the_wrong_type(data, message):
    with pytest.raises(ProbeReportError) as exc:
        parse_probe_report(data)
    assert str(exc.value) == message


def test_parse_reads_the_fields_the_checks_use():
    rep = parse_probe_report(dict(healthy(), port=4000, stale_sessions={"count": 2, "paths": ["/tmp/prted.5"]}))
    assert rep.ok and rep.hostname == "h1" and rep.port == 4000
    assert rep.at("cwd").isdir and not rep.at("program").exists
    assert rep.python.mpi4py == "4.1.2" and rep.stale_sessions.paths == ("/tmp/prted.5",)
    assert rep.versions == {} and "mpirun" in rep.which  # a None version is no version


def test_traceback_before_the_program_shows_an_option_error_in_full(capsys):
    # The bad --mca is found while dtrun splits argv, before typer would have seen --traceback.
    with pytest.raises(UsageError, match="not an MCA parameter name"):
        cli.main(["--traceback", "--mca", "bad-key", "v", "true"])


def test_traceback_after_the_program_is_the_programs(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["-H", "a:x", "true", "--traceback"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "dtrun: error: -H: slots for a must be a positive integer, got 'x'\n"


def test_read_invocation_skips_option_values_and_stops_at_the_program():
    assert cli.read_invocation(["-np", "2", "--traceback", "prog"]).traceback
    assert cli.read_invocation(["--host=a", "--traceback", "prog"]).traceback
    assert not cli.read_invocation(["-np", "2", "prog", "--traceback"]).traceback
    assert not cli.read_invocation(["--", "--traceback"]).traceback
    assert cli.read_invocation(["bench", "-b", "1M", "--traceback"]).traceback
    assert not cli.read_invocation(["bench", "--", "--traceback"]).traceback
    assert not cli.read_invocation(["doctor", "--traceback"]).traceback
