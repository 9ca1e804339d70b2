"""The CLI as users call it: messages and exit codes for bad input, --dry-run, hosts."""
import json
import os
import time

import pytest
from typer.testing import CliRunner

from dtrun.launcher.cli import run_app, sub_app
from dtrun.launcher.optargs import LaunchArgv, read_launch_argv
from tests.dtrun_helpers import DTRUN, REPO, dtrun, one_line_error


def test_bad_host_list(tmp_path):
    one_line_error(dtrun("-H", "a:0,b:2", "true"), "-H: slots for a must be a positive integer, got 0")
    one_line_error(dtrun("-H", "a:x", "true"), "got 'x'")
    one_line_error(dtrun("-H", "-oProxyCommand=evil", "true"))


def test_malformed_hostfile_names_file_and_line(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("node1 slots=2\n# comment\nnode2 slots=-1\n")
    one_line_error(dtrun("--hostfile", hf, "true"), f"{hf}:3: slots must be a positive integer, got -1")


def test_bad_cluster_file_names_line(tmp_path):
    cf = tmp_path / "c.yaml"
    cf.write_text("hosts:\n  - a\n  - {name: b, slots: two}\n")
    one_line_error(dtrun("--cluster", cf, "true"), f"{cf}:3: slots must be a positive integer, got 'two'")


def test_np_zero_and_too_many():
    one_line_error(dtrun("-np", "0", "-H", "localhost:2", "true"), "-np must be a positive integer, got 0")
    line = one_line_error(dtrun("-np", "5", "-H", "localhost:2", "true"), "-np 5 is more than the 2 slots")
    assert "--oversubscribe" in line
    one_line_error(dtrun("-np", "two", "true"), "-np")


def test_unknown_include_host():
    one_line_error(dtrun("-H", "a,b", "--include", "c", "true"), "--include: c not in the host list")


def test_missing_mpirun():
    one_line_error(dtrun("--mpirun", "/nonexistent/mpirun", "-np", "1", "true"), "--mpirun /nonexistent/mpirun: no such file")


def test_not_an_mpi(tmp_path):
    one_line_error(dtrun("--mpirun", "/bin/echo", "-np", "1", "true"), "unrecognised MPI")


def test_no_program():
    one_line_error(dtrun("-np", "1"), "no program given")


def test_bad_env_name():
    one_line_error(dtrun("-x", "1BAD=2", "true"), "-x '1BAD=2'")


def test_include_and_exclude_iface_together():
    one_line_error(dtrun("--include-iface", "eth0", "--exclude-iface", "lo", "true"), "cannot be used together")


def test_traceback_flag_shows_the_traceback():
    p = dtrun("--traceback", "-np", "0", "true")
    assert p.returncode != 0 and "Traceback" in p.stderr


def test_dry_run_prints_command_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    p = dtrun("--dry-run", "-np", "2", "-H", "localhost:2", "-x", "HF_TOKEN=hf_secret", "--mca", "btl_tcp_links", "2",
              "touch", marker)
    assert p.returncode == 0, p.stderr
    assert not marker.exists()
    assert "hf_secret" not in p.stdout and "HF_TOKEN=<redacted>" in p.stdout
    assert "--mca btl_tcp_links 2" in p.stdout
    assert "# no core pinning" in p.stdout
    assert p.stdout.splitlines()[0].startswith("# Open MPI 5.")


def test_program_options_are_not_parsed_by_dtrun():
    p = dtrun("--dry-run", "-H", "localhost:1", "python", "train.py", "-np", "7", "--mca", "x")
    assert p.returncode == 0, p.stderr
    from tests.dtrun_helpers import BIN
    # the command name is resolved on this shell's PATH, the arguments are left alone
    assert f"-- {BIN}/python train.py -np 7 --mca x" in p.stdout
    p2 = dtrun("--dry-run", "-H", "localhost:1", "--", "--weird-program")
    assert p2.returncode == 0 and "-- --weird-program" in p2.stdout


def test_duplicate_hosts_warn_and_merge():
    p = dtrun("--dry-run", "-H", "localhost:1,localhost:2", "true")
    assert p.returncode == 0
    assert "dtrun: warning: host localhost is listed more than once; merged into 3 slots" in p.stderr
    assert "-H localhost:3" in p.stdout


def test_hosts_json_and_table():
    p = dtrun("hosts", "--hostfile", "hostfiles/cluster-4x4", "--exclude", "server2", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert [h["host"] for h in data["hosts"]] == ["server1", "server3", "server4"]
    assert data["total_slots"] == 12
    t = dtrun("hosts", "--cluster", "hostfiles/cluster.yaml")
    assert t.returncode == 0 and "server4" in t.stdout and "2222" in t.stdout and "ops" in t.stdout


def test_mca_is_read_only_before_the_program():
    from dtrun.launcher.cli import launch_table
    read = read_launch_argv(["--mca", "a", "b", "-x", "--mca", "prog", "--mca", "c", "d"], launch_table())
    assert read.options == ("-x", "--mca") and read.mca == (("a", "b"),)
    assert read.program == ("prog", "--mca", "c", "d")


def test_clirunner_help_lists_options_and_subcommands():
    r = CliRunner().invoke(run_app, ["--help"])
    assert r.exit_code == 0
    for opt in ("-np", "--hostfile", "--cluster", "--dry-run", "--include-iface", "--log-dir", "--mpirun"):
        assert opt in r.output
    assert "dtrun hosts | smoke | bench | doctor | keyscan" in r.output.replace("\n", " ")
    r = CliRunner().invoke(sub_app, ["hosts", "--help"])
    assert r.exit_code == 0 and "--json" in r.output


def test_dtrun_script_does_not_import_heavy_modules():
    import subprocess, sys
    code = ("import sys; sys.argv=['dtrun','--dry-run','-H','localhost:2','true'];"
            "import dtrun.launcher.cli as c\ntry:\n c.main()\nexcept SystemExit: pass\n"
            "heavy=[m for m in ('paramiko','mpi4py','numpy','rich.table','yaml') if m in sys.modules];"
            "print('HEAVY', heavy, file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert "HEAVY []" in p.stderr, p.stderr


def test_cluster_file_ssh_settings_reach_the_launcher(tmp_path):
    from tests.dtrun_helpers import user_env
    p = dtrun("--dry-run", "--no-preflight", "--cluster", "hostfiles/cluster.yaml", "true", env=user_env(XDG_CACHE_HOME=str(tmp_path)))
    assert p.returncode == 0, p.stderr
    m = [l for l in p.stdout.splitlines() if "plm_ssh_args" in l]
    assert m, p.stdout
    cfg = m[0].split("'-F ")[1].split("'")[0]
    # --dry-run shows the config a launch would write, and writes nothing
    assert not os.path.exists(cfg) and not (tmp_path / "dtrun").exists()
    assert f"# a launch first writes {cfg} (--dry-run wrote nothing):" in p.stdout
    text = "\n".join(l[4:] for l in p.stdout.split(cfg, 1)[1].splitlines()[1:] if l.startswith("#   ")) + "\n"
    assert "Host server4\n  User ops\n  Port 2222\n" in text
    assert "Host server1\n  User mpiuser\n" in text and "IdentityFile" in text


def test_slurm_allocation_is_used_without_host_options():
    from tests.dtrun_helpers import user_env
    env = user_env(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node[01-02,07]", SLURM_TASKS_PER_NODE="4(x2),2")
    p = dtrun("--dry-run", "--no-preflight", "--launcher", "mpirun", "true", env=env)
    assert p.returncode == 0, p.stderr
    assert "-np 10" in p.stdout and "-H node01:4,node02:4,node07:2" in p.stdout
    assert "from Slurm allocation" in p.stdout


def test_many_hosts_warn_about_tree_spawn(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("".join(f"10.9.{i // 250}.{i % 250 + 1} slots=1\n" for i in range(70)))
    p = dtrun("--dry-run", "--no-preflight", "--hostfile", hf, "true")
    assert p.returncode == 0
    assert "70 hosts: Open MPI spawns daemons through a tree" in p.stderr and "--no-tree-spawn" in p.stderr
    p = dtrun("--dry-run", "--no-preflight", "--hostfile", hf, "--no-tree-spawn", "true")
    assert "--prtemca plm_ssh_no_tree_spawn 1" in p.stdout and "tree" not in p.stderr


def test_program_name_resolves_on_the_launching_path(tmp_path):
    from dtrun.launcher.launch import resolve_program
    exe = tmp_path / "mytool"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin"}
    assert resolve_program(("mytool", "-x", "python"), env) == (str(exe), "-x", "python")
    assert resolve_program(("./rel/prog", "a"), env) == ("./rel/prog", "a")  # a path is left alone
    assert resolve_program(("not-on-path",), env) == ("not-on-path",)


def test_a_new_option_is_known_to_the_pass_through_without_a_second_list():
    """The value-taking options come from the typer command itself: an option added there
    (by any engineer, with any name) splits PROGRAM correctly with no other change."""
    from typing import Optional
    import typer
    import typer.main
    from dtrun.launcher.cli import option_table

    app = typer.Typer(add_completion=False)

    @app.command(context_settings={"help_option_names": ["-h", "--help"]})
    def cmd(program: list[str] = typer.Argument(None),
            brand_new: Optional[str] = typer.Option(None, "--brand-new", "-B"),
            flag: bool = typer.Option(False, "--flag"),
            mca: list[str] = typer.Option([], "--mca")):
        pass

    table = option_table(typer.main.get_command(app))
    assert table == {"--brand-new": 1, "-B": 1, "--flag": 0, "--mca": 2, "-h": 0, "--help": 0}
    assert read_launch_argv(["-B", "v", "--flag", "prog", "-B", "x"], table) == LaunchArgv(("-B", "v", "--flag"), (), ("prog", "-B", "x"))
    assert read_launch_argv(["--brand-new=v", "--", "--prog"], table) == LaunchArgv(("--brand-new", "v"), (), ("--prog",))
