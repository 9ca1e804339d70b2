"""Golden mpirun command lines per flavor, redaction, and the exit-code mapping (values only)."""
import os
import re
import shlex
import signal
import sys

import pytest

from dtrun.launcher.remote import rankexec
from dtrun.launcher.command import COLL_RULES, LaunchSpec, build_command, format_dry_run, build_groups, redact_args
from dtrun.launcher.errors import ExitCode, MpiFlavorError, UsageError
from dtrun.launcher.flavors import MPICH, OPENMPI, Flavor, parse_version_output
from dtrun.launcher.hostfile import parse_host_list
from dtrun.launcher.job.markers import parse_marker
from dtrun.launcher.job.result import JobResult, RankFailure, StopReason, StopState, exit_code_for
from dtrun.launcher.job.summary import failure_summary

OMPI4 = Flavor(OPENMPI, (4, 1, 4), "/usr/bin/mpirun", "/usr")
OMPI5 = Flavor(OPENMPI, (5, 0, 11), "/venv/bin/mpirun", "/venv")
HYDRA = Flavor(MPICH, (4, 0, 2), "/usr/bin/mpiexec.hydra", "/usr")
W = ("/venv/bin/python3", "-S", "/src/launcher/rankexec.py", "--")
COLL = f"--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_dynamic_rules_filename {COLL_RULES}"


def spec(**kw):
    base = dict(program=("python", "train.py", "--lr", "0.1"), hosts=tuple(parse_host_list("s1:4,s2:4")), np=8,
                env_names_set=frozenset({"LD_LIBRARY_PATH"}), as_root=False, rank_wrapper=W, tag_output=True)
    base.update(kw)
    return LaunchSpec(**base)


def line(args):
    return shlex.join(args)


def test_openmpi5_golden():
    assert line(build_command(spec(), OMPI5)) == (
        "/venv/bin/mpirun -np 8 -H s1:4,s2:4 --prefix /venv --bind-to none --map-by slot "
        f"--mca pml ob1 --mca btl self,sm,tcp {COLL} --mca osc '^ucx' --mca btl_tcp_if_exclude lo,docker0 "
        "--output tag "
        "-x PATH -x LD_LIBRARY_PATH -x 'NCCL_SOCKET_IFNAME=^lo,docker0' -x DTRUN_MARKER_TOKEN "
        "/venv/bin/python3 -S /src/launcher/rankexec.py -- python train.py --lr 0.1")


def test_openmpi4_golden():
    assert line(build_command(spec(oversubscribe=True, as_root=True), OMPI4)) == (
        "/usr/bin/mpirun -np 8 -H s1:4,s2:4 --prefix /usr --allow-run-as-root --bind-to none --map-by slot "
        f"--oversubscribe --mca pml ob1 --mca btl self,vader,tcp {COLL} --mca btl_tcp_if_exclude lo,docker0 "
        "--mca oob_tcp_if_exclude lo,docker0 --tag-output "
        "-x PATH -x LD_LIBRARY_PATH -x 'NCCL_SOCKET_IFNAME=^lo,docker0' -x DTRUN_MARKER_TOKEN "
        "/venv/bin/python3 -S /src/launcher/rankexec.py -- python train.py --lr 0.1")


def test_mpich_golden():
    assert line(build_command(spec(env=("OMP_NUM_THREADS=4", "HOME")), HYDRA)) == (
        "/usr/bin/mpiexec.hydra -n 8 -hosts s1:4,s2:4 -prepend-rank "
        "-genvlist PATH,LD_LIBRARY_PATH,DTRUN_MARKER_TOKEN,HOME -genv NCCL_SOCKET_IFNAME '^lo,docker0' -genv OMP_NUM_THREADS 4 "
        "/venv/bin/python3 -S /src/launcher/rankexec.py -- python train.py --lr 0.1")


def test_openmpi5_include_cidr_names_runtime_and_pmix_too():
    args = build_command(spec(include_iface=("10.1.0.0/24",), iface_reason="shared subnet"), OMPI5)
    text = line(args)
    assert "--mca btl_tcp_if_include 10.1.0.0/24 --prtemca prte_if_include 10.1.0.0/24 " \
           "--pmixmca ptl_base_if_include 10.1.0.0/24" in text
    assert "exclude" not in text.replace("NCCL_SOCKET_IFNAME=^lo,docker0", "")
    # NCCL takes interface names, not subnets: it keeps the exclude list
    assert "NCCL_SOCKET_IFNAME=^lo,docker0" in text


def test_openmpi4_include_iface_name_reaches_oob_and_nccl():
    text = line(build_command(spec(include_iface=("eth0",)), OMPI4))
    assert "--mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0" in text
    assert "-x NCCL_SOCKET_IFNAME=eth0" in text


def test_mpich_include_iface():
    assert "-iface ib0" in line(build_command(spec(include_iface=("ib0",)), HYDRA))


def test_local_only_skips_interface_and_prefix_flags():
    text = line(build_command(spec(hosts=tuple(parse_host_list("localhost:2")), np=2, local_only=True, tag_output=False), OMPI5))
    assert "if_exclude" not in text and "NCCL_SOCKET_IFNAME" not in text and "--prefix" not in text
    assert "--output tag" not in text


def test_allreduce_rules_across_hosts_only_for_open_mpi_and_never_over_the_users():
    text = format_dry_run(build_groups(spec(), OMPI5))
    rules = next(ln for ln in text.splitlines() if "coll_tuned_dynamic_rules_filename" in ln)
    assert "allreduce of 1 MiB or more on 3 ranks or more as a ring" in rules and COLL_RULES in rules
    assert COLL in line(build_command(spec(), OMPI4))
    local = spec(hosts=tuple(parse_host_list("localhost:2")), np=2, local_only=True)
    for quiet in (line(build_command(local, OMPI5)), line(build_command(spec(), HYDRA))):
        assert "coll_tuned" not in quiet
    # the user's own coll/tuned choice, however given, is the only one on the line
    for own in (dict(mca=(("coll_tuned_allreduce_algorithm", "3"),)),
                dict(env=("OMPI_MCA_coll_tuned_use_dynamic_rules=0",)),
                dict(env_names_set=frozenset({"OMPI_MCA_coll_tuned_dynamic_rules_filename"})),
                dict(mpi_args=("--mca", "coll_tuned_allreduce_algorithm", "2")),
                dict(mca=(("coll_tuned_bcast_algorithm", "3"),)),  # inert alone; dtrun's rules would wake it
                dict(env_names_set=frozenset({"OMPI_MCA_coll_tuned_bcast_algorithm"}))):
        text = line(build_command(spec(**own), OMPI5))
        assert COLL_RULES not in text, own


def test_oversubscribe_spelling_per_version():
    assert "--map-by slot:oversubscribe" in line(build_command(spec(oversubscribe=True), OMPI5))
    assert "--oversubscribe" not in line(build_command(spec(oversubscribe=True), OMPI5))


def test_ssh_config_and_no_tree_spawn_per_version():
    s = spec(ssh_config="/c/ssh_config", no_tree_spawn=True)
    assert "--prtemca plm_ssh_args '-F /c/ssh_config' --prtemca plm_ssh_no_tree_spawn 1" in line(build_command(s, OMPI5))
    assert "--mca plm_rsh_args '-F /c/ssh_config' --mca plm_rsh_no_tree_spawn 1" in line(build_command(s, OMPI4))
    assert "-launcher-exec /w/ssh" in line(build_command(spec(ssh_config="/c", ssh_wrapper="/w/ssh"), HYDRA))


def test_a_restarts_control_path_joins_the_ssh_config_in_open_mpis_ssh_args():
    """A later attempt's daemons reach their hosts through the run's ssh connections (launcher/sshmux.py):
    one argument string with the config, for both Open MPI versions; Hydra's own ssh is left as it is."""
    s = spec(ssh_config="/c/ssh_config", ssh_control_path="/k/mux-1a2b/%C")
    want = "'-F /c/ssh_config -o ControlMaster=no -o ControlPath=/k/mux-1a2b/%C'"
    assert f"--prtemca plm_ssh_args {want}" in line(build_command(s, OMPI5))
    assert f"--mca plm_rsh_args {want}" in line(build_command(s, OMPI4))
    alone = line(build_command(spec(ssh_control_path="/k/mux-1a2b/%C"), OMPI5))
    assert "--prtemca plm_ssh_args '-o ControlMaster=no -o ControlPath=/k/mux-1a2b/%C'" in alone
    assert "ControlPath" not in line(build_command(spec(ssh_config="/c", ssh_wrapper="/w/ssh",
                                                         ssh_control_path="/k/%C"), HYDRA))
    from dtrun.launcher.errors import InvalidValue
    with pytest.raises(InvalidValue):
        build_command(spec(ssh_control_path="/k/a b/%C"), OMPI5)
    # the user's own ssh settings for Open MPI (say, a port) would be replaced: they are left alone
    for own in (dict(mca=(("plm_ssh_args", "-p 2222"),)), dict(mpi_args=("--prtemca", "plm_ssh_agent", "rsh")),
                dict(env_names_set=frozenset({"PRTE_MCA_plm_ssh_args"})),
                dict(env_names_set=frozenset({"OMPI_MCA_plm_rsh_args"}))):
        assert "ControlPath" not in line(build_command(spec(ssh_control_path="/k/%C", **own), OMPI5)), own


def test_ssh_config_path_open_mpi_would_split_is_refused():
    """ORTE and PRRTE split plm_ssh_args on spaces, with no quoting: such a path never reaches them."""
    from dtrun.launcher.errors import InvalidValue
    for bad in ("/c/ssh config", "/x -oProxyCommand=touch", "/c/a\nb"):
        for flavor in (OMPI4, OMPI5):
            with pytest.raises(InvalidValue):
                build_command(spec(ssh_config=bad), flavor)


def test_user_env_mca_mpi_args_and_nccl_debug():
    s = spec(env=("NCCL_SOCKET_IFNAME=ib0", "FOO"), mca=(("btl_tcp_links", "2"),),
             mpi_args=("--report-bindings",), nccl_debug="INFO")
    args = build_command(s, OMPI5)
    text = line(args)
    assert "-x NCCL_SOCKET_IFNAME=ib0" in text and "^lo,docker0" not in text  # the user's value wins
    assert "-x NCCL_DEBUG=INFO" in text and "-x FOO" in text
    assert "--mca btl_tcp_links 2 --report-bindings /venv/bin/python3" in text
    assert args[-4:] == ["python", "train.py", "--lr", "0.1"]  # the program comes last, untouched


def test_mca_with_mpich_is_a_usage_error():
    from dtrun.launcher.hosts import HostSelection
    from dtrun.launcher.launch import LaunchOptions
    from dtrun.launcher.usage import check_usage
    selection = HostSelection(tuple(parse_host_list("s1:1")), "-H")
    with pytest.raises(UsageError, match="--mca is an Open MPI option"):
        check_usage(LaunchOptions(program=("true",), mca=(("a", "b"),)), HYDRA, selection, {})


def test_redaction_of_secret_looking_values():
    args = ["-x", "HF_TOKEN=abc", "-x", "AWS_SECRET_ACCESS_KEY=s3", "-x", "DB_PASSWORD=pw",
            "-x", "OMP_NUM_THREADS=4", "-genv", "API_KEY", "k", "-x", "PATH"]
    assert redact_args(args) == ["-x", "HF_TOKEN=<redacted>", "-x", "AWS_SECRET_ACCESS_KEY=<redacted>",
                                 "-x", "DB_PASSWORD=<redacted>", "-x", "OMP_NUM_THREADS=4",
                                 "-genv", "API_KEY", "<redacted>", "-x", "PATH"]


def test_dry_run_format_is_commented_and_redacted():
    out = format_dry_run(build_groups(spec(env=("WANDB_API_KEY=xyz",)), OMPI5), "hdr")
    assert "xyz" not in out and "WANDB_API_KEY=<redacted>" in out
    lines = out.splitlines()
    assert lines[0] == "# hdr" and lines[1] == "mpirun_cmd=(" and lines[-1] == '"${mpirun_cmd[@]}"'
    bind = next(l for l in lines if l.strip().startswith("--bind-to none"))
    assert "# no core pinning" in bind


@pytest.mark.parametrize("text, kind, version", [
    ("mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n", OPENMPI, (5, 0, 11)),
    ("mpirun (Open MPI) 4.1.4\n", OPENMPI, (4, 1, 4)),
    ("mpirun.openmpi (OpenRTE) 4.1.4\n", OPENMPI, (4, 1, 4)),
    ("HYDRA build details:\n    Version:                                 4.0.2\n    Release Date: x\n", MPICH, (4, 0, 2)),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n", MPICH, (2021, 10)),
])
def test_version_parsing(text, kind, version):
    assert parse_version_output(text) == (kind, version)


def test_unknown_mpi_is_a_clear_error():
    with pytest.raises(MpiFlavorError, match="unrecognised MPI: 'mpirun --version' said 'Sun HPC 8'"):
        parse_version_output("Sun HPC 8\n")


def test_exit_code_mapping():
    assert exit_code_for(0, [], False) == 0
    assert exit_code_for(3, [], False) == 3
    assert exit_code_for(-signal.SIGKILL, [], False) == 128 + 9
    assert exit_code_for(0, [RankFailure("1", "h", signum=9)], False) == 137  # never 0 for a killed rank
    assert exit_code_for(1, [], True) == ExitCode.INTERRUPTED == 130
    assert exit_code_for(0, [], True, signal.SIGTERM) == 143
    assert int(ExitCode.USAGE) == 2 and int(ExitCode.FAILED) == 1


def test_marker_parsing_through_tag_prefix():
    f = parse_marker("[1,3]<stderr>: dtrun-rank-exit: rank=3 host=node2 code=7\n")
    assert (f.rank, f.host, f.code, f.signum) == ("3", "node2", 7, None)
    f = parse_marker("dtrun-rank-exit: rank=0 host=a signal=11")
    assert f.signum == 11 and f.how == "killed by SIGSEGV"
    assert parse_marker("an ordinary line") is None


def test_failure_summary_names_first_rank_host_and_log():
    r = JobResult(returncode=7, mpirun_returncode=7, failures=[RankFailure("3", "node2", code=7), RankFailure("0", "node1", signum=15)])
    text = failure_summary(r, "/logs")
    assert text.splitlines()[0] == "dtrun: job failed: rank 3 on node2 exited with code 7 (1 other rank stopped too)"
    assert "host       : node2" in text and "/logs/rank.3.log" in text


def test_rank_env_from_each_flavor():
    assert rankexec.rank_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                              "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == \
        {"DTRUN_RANK": "3", "DTRUN_LOCAL_RANK": "1", "DTRUN_SIZE": "8", "DTRUN_LOCAL_SIZE": "4"}
    assert rankexec.rank_env({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}) == \
        {"DTRUN_RANK": "2", "DTRUN_LOCAL_RANK": "0", "DTRUN_SIZE": "4", "DTRUN_LOCAL_SIZE": "2"}


def test_python_programs_are_run_under_mpi4py_abort_handler():
    py = sys.executable
    assert rankexec.with_abort_on_exception([py, "train.py", "-x"]) == [py, "-m", "mpi4py", "train.py", "-x"]
    assert rankexec.with_abort_on_exception([py, "-u", "-W", "ignore", "-m", "pkg.mod"]) == \
        [py, "-u", "-W", "ignore", "-m", "mpi4py", "-m", "pkg.mod"]
    assert rankexec.with_abort_on_exception([py, "-c", "pass"]) == [py, "-m", "mpi4py", "-c", "pass"]
    assert rankexec.with_abort_on_exception([py, "-m", "mpi4py", "x.py"]) == [py, "-m", "mpi4py", "x.py"]
    assert rankexec.with_abort_on_exception(["/bin/sh", "-c", "true"]) == ["/bin/sh", "-c", "true"]
    assert rankexec.with_abort_on_exception(["/other/env/bin/python", "x.py"]) == ["/other/env/bin/python", "x.py"]


def test_root_cause_first_whatever_the_arrival_order():
    from dtrun.launcher.job.result import order_failures
    killed = RankFailure("0", "h1", signum=15)
    failed = RankFailure("2", "h3", code=5)
    segv = RankFailure("1", "h2", signum=11)
    assert order_failures([killed, failed]) == [failed, killed]
    assert order_failures([killed, segv, failed]) == [segv, failed, killed]
    assert order_failures([killed, failed, segv], reported_rank="1") == [segv, failed, killed]


def test_shared_subnet_is_the_local_network_holding_every_host():
    import ipaddress
    from dtrun.launcher.netinfo import shared_subnet
    nets = [("docker0", ipaddress.ip_network("172.17.0.0/16")), ("eth0", ipaddress.ip_network("10.0.0.0/24")),
            ("ib0", ipaddress.ip_network("10.1.0.0/16"))]
    s = shared_subnet(["10.0.0.11", "10.0.0.12"], nets)
    assert (s.iface, s.cidr) == ("eth0", "10.0.0.0/24")
    assert shared_subnet(["10.1.3.4", "10.1.200.1"], nets).cidr == "10.1.0.0/16"
    assert shared_subnet(["10.0.0.11", "10.1.0.1"], nets) is None  # no one network holds both
    assert shared_subnet(["172.17.0.5"], nets) is None  # docker0 never counts
    assert shared_subnet([], nets) is None


@pytest.mark.cluster
def test_local_networks_lists_exactly_the_up_non_loopback_networks():
    """In a fresh network namespace with a known set of interfaces (real ones, made with
    ``ip``): one up veth with an address, one down veth with an address, and lo."""
    import secrets
    import shutil
    import subprocess

    from tests.dtrun_helpers import PYTHON, REPO
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    ns = f"dtrun-nets-{secrets.token_hex(3)}"

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    ip("netns", "add", ns)
    try:
        ip("-n", ns, "link", "add", "up0", "type", "veth", "peer", "name", "up1")
        ip("-n", ns, "link", "add", "dn0", "type", "veth", "peer", "name", "dn1")
        ip("-n", ns, "addr", "add", "10.77.1.2/24", "dev", "up0")
        ip("-n", ns, "addr", "add", "10.78.0.2/16", "dev", "dn0")
        for dev in ("lo", "up0", "up1"):
            ip("-n", ns, "link", "set", dev, "up")
        out = subprocess.run(
            ["ip", "netns", "exec", ns, PYTHON, "-c",
             "from dtrun.launcher.netinfo import local_networks; print(sorted((n, str(c)) for n, c in local_networks()))"],
            capture_output=True, text=True, timeout=30, cwd=REPO)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('up0', '10.77.1.0/24')]"


def test_exclude_iface_adds_to_the_default_never_replaces_it():
    from dtrun.launcher.launch import exclusions
    merged, why = exclusions(("docker0",))
    assert merged == ("lo", "docker0") and "nothing new" in why
    merged, why = exclusions(("eth9", "lo", "ib1"))
    assert merged == ("lo", "docker0", "eth9", "ib1")
    assert why == "eth9, ib1 from --exclude-iface, added to dtrun's default lo,docker0"
    text = line(build_command(spec(exclude_iface=merged, iface_reason=why), OMPI4))
    assert "--mca btl_tcp_if_exclude lo,docker0,eth9,ib1 --mca oob_tcp_if_exclude lo,docker0,eth9,ib1" in text
    assert "NCCL_SOCKET_IFNAME=^lo,docker0,eth9,ib1" in text


def test_log_dir_run_id_sorts_by_time_and_names_the_process():
    from dtrun.launcher.launch import new_run_id
    assert re.search(r"-42-[0-9a-f]{8}$", new_run_id(now=0, pid=42))
    assert new_run_id(now=1e9, pid=1) < new_run_id(now=2e9, pid=1)


# ---- lifecycle: honest names, exit codes and notes (values only) ----------------------------

def test_marker_says_whether_the_signal_came_from_the_teardown():
    own = parse_marker("dtrun-rank-exit: rank=2 host=n3 signal=9 forwarded=0")
    torn = parse_marker("[1,0]<stderr>: dtrun-rank-exit: rank=0 host=n1 signal=15 forwarded=1")
    assert (own.signum, own.forwarded, own.torn_down) == (9, False, False)
    assert torn.torn_down


def test_kill_9_of_a_rank_beats_open_mpis_abort_report():
    from dtrun.launcher.job.result import order_failures
    killed = parse_marker("dtrun-rank-exit: rank=1 host=n2 signal=9 forwarded=0")
    aborted = RankFailure("0", "n1", code=14)  # a consequence: its peer vanished
    torn = parse_marker("dtrun-rank-exit: rank=2 host=n3 signal=15 forwarded=1")
    assert order_failures([aborted, torn, killed], reported_rank="0") == [killed, aborted, torn]
    assert exit_code_for(14, [killed, aborted, torn], False) == 137


def test_failing_rank_code_wins_over_the_launchers_own_code():
    # Hydra reports its own code (seen: 15 for a rank's exit 3); the rank's code is what dtrun exits with
    assert exit_code_for(15, [RankFailure("1", "h", code=3)], False) == 3
    torn = RankFailure("0", "h", signum=15, forwarded=True)
    assert exit_code_for(1, [torn], False) == 1  # only torn-down ranks: mpirun's code stands


def test_stdout_closed_is_not_blamed_on_a_rank():
    from dtrun.launcher.job.result import SIGPIPE_EXIT
    r = JobResult(returncode=SIGPIPE_EXIT, mpirun_returncode=1, failures=[RankFailure("0", "h", signum=15, forwarded=True)],
                  stops=[StopState(StopReason.STDOUT_CLOSED, "stdout closed")])
    text = failure_summary(r)
    assert "stdout was closed" in text and "rank 0" not in text


def test_a_daemon_whose_ssh_session_ended_after_its_ranks_started_was_lost():
    """Open MPI 5's words when a daemon started through an ssh master connection loses its host
    (launcher/sshmux.py): "failed to report back", though its ranks ran. Only then is it a lost
    daemon; before any rank started there, it is what it says (a daemon that never came up)."""
    from dtrun.launcher.job.parsers import dropped_daemon_host
    text = ("A daemon failed to report back after being spawned. This could\nbe due to several factors, "
            "including inability to find the\n...\n  Local host:    vm\n  Remote host:   node-h2\n"
            "  Daemon exit status: 255\n\nThis may also be caused by a firewall on the remote host.\n")
    assert dropped_daemon_host(text, ["node-h1", "node-h2"]) == "node-h2"
    assert dropped_daemon_host(text, ["node-h2.cluster.example"]) == "node-h2"
    assert dropped_daemon_host(text, ["node-h1", "node-h3"]) is None  # it never ran a rank
    assert dropped_daemon_host(text.replace("status: 255", "status: 127"), ["node-h2"]) is None


def test_lost_daemon_names_its_host():
    from dtrun.launcher.job.parsers import lost_daemon_host
    text = ("PRTE has lost communication with a remote daemon.\n\n"
            "  HNP daemon   : [prterun-vm-18823@0,0] on node vm\n"
            "  Remote daemon: [prterun-vm-18823@0,2] on node dt03e6-h2\n")
    assert lost_daemon_host(text) == "dt03e6-h2"
    assert lost_daemon_host("ordinary output\n") is None
    r = JobResult(returncode=1, mpirun_returncode=0, failures=[], lost_daemon_host="dt03e6-h2")
    assert "the MPI daemon on dt03e6-h2 died" in failure_summary(r)


def test_timeout_and_signal_summaries():
    r = JobResult(returncode=ExitCode.TIMEOUT, mpirun_returncode=-9, failures=[],
                  stops=[StopState(StopReason.TIMEOUT, "the job ran longer than --timeout 5 s")], forced=True)
    text = failure_summary(r)
    assert text.startswith("dtrun: the job ran longer than --timeout 5 s; the job was stopped (exit 124)")
    assert "did not stop within" in text
    assert failure_summary(JobResult(returncode=129, mpirun_returncode=0, failures=[],
                                     stops=[StopState(StopReason.SIGNAL, "stopped by SIGHUP", signal.SIGHUP)])).startswith(
        "dtrun: stopped by SIGHUP; mpirun stopped the job on every host")
    assert exit_code_for(0, [], True, signal.SIGHUP) == 129
    assert exit_code_for(0, [], True, signal.SIGQUIT) == 131


def test_start_timeout_names_hosts_of_missing_ranks():
    from dtrun.launcher.job.result import expected_hosts
    from dtrun.launcher.job.summary import not_started_message
    expected = expected_hosts(tuple(parse_host_list("a:2,b:1,c:1")), 4)
    assert expected == ["a", "a", "b", "c"]
    msg = not_started_message(expected, {"0": "a", "1": "a"}, 30)
    assert msg.startswith("2 of 4 ranks had not started after --start-timeout 30 s; not up: b (rank 2); c (rank 3)")


def test_every_catchable_terminating_signal_stops_the_job():
    from dtrun.launcher.job.supervisor import STOP_SIGNALS
    for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
              signal.SIGALRM, signal.SIGXCPU):
        assert s in STOP_SIGNALS


def test_mpich_notes_for_options_hydra_cannot_take():
    from dtrun.launcher.command import flavor_notes
    notes = flavor_notes(spec(no_tree_spawn=True, exclude_iface=("lo", "docker0", "eth1")), HYDRA)
    assert any(n.startswith("--no-tree-spawn: Hydra starts every proxy from this host") for n in notes)
    assert any(n.startswith("--exclude-iface eth1: Hydra has no exclude list") for n in notes)
    assert "-iface" not in line(build_command(spec(exclude_iface=("lo", "docker0", "eth1")), HYDRA))
    assert flavor_notes(spec(no_tree_spawn=True), OMPI5) == []


def test_mpich_subnet_maps_to_the_one_interface_name_every_host_uses():
    ifaces = (("s1", (("eth0", "10.1.0.11/24"), ("docker0", "172.17.0.1/16"))),
              ("s2", (("eth0", "10.1.0.12/24"),)))
    s = spec(include_iface=("10.1.0.0/24",), iface_reason="shared subnet", host_ifaces=ifaces,
             launcher_addr="10.1.0.1")
    text = line(build_command(s, HYDRA))
    assert "-iface eth0 -localhost 10.1.0.1 " in text
    differ = (("s1", (("eth0", "10.1.0.11/24"),)), ("s2", (("ens5", "10.1.0.12/24"),)))
    from dtrun.launcher.command import flavor_notes
    s2 = spec(include_iface=("10.1.0.0/24",), host_ifaces=differ)
    assert "-iface" not in line(build_command(s2, HYDRA))
    assert any("interface names on that subnet differ between hosts (s1: eth0; s2: ens5)" in n
               for n in flavor_notes(s2, HYDRA))
    # in a dry run (no preflight) the subnet cannot be mapped yet: said, not dropped
    assert any("Hydra takes an interface name, not a subnet" in n
               for n in flavor_notes(spec(include_iface=("10.1.0.0/24",)), HYDRA))


def test_dry_run_prints_notes():
    text = format_dry_run(build_groups(spec(), HYDRA), "MPICH", ["--no-tree-spawn: nothing to add"])
    assert text.splitlines()[1] == "# note: --no-tree-spawn: nothing to add"


def test_earliest_exit_is_the_root_cause_not_the_peer_that_aborted_after_it():
    from dtrun.launcher.job.result import order_failures
    exited = parse_marker("dtrun-rank-exit: rank=2 host=h3 code=3 t=1000.100000")
    aborted = parse_marker("[1,1]<stderr>: dtrun-rank-exit: rank=1 host=h2 code=14 t=1000.350000")
    assert order_failures([aborted, exited], reported_rank="1") == [exited, aborted]
    assert exit_code_for(14, order_failures([aborted, exited], "1"), False) == 3


def test_end_of_output_markers_are_taken_out_of_stdout_whatever_the_tag_or_chunking():
    from dtrun.launcher.job.markers import split_eof_markers
    raw = "[1,1]<stdout>: a\n[1,1]<stdout>: dtrun-rank-eof: rank=1\n[1,0]<stdout>: b\n[1,0]<stdout>:dtrun-rank-eof: rank=0\n"
    for cut in range(len(raw) + 1):
        seen = set()
        first, held = split_eof_markers(raw[:cut], seen)
        second, rest = split_eof_markers(held + raw[cut:], seen)
        assert first + second + rest == "[1,1]<stdout>: a\n[1,0]<stdout>: b\n", cut
        assert seen == {"0", "1"}
    seen = set()
    assert split_eof_markers("no newline at the enddtrun-rank-eof: rank=3\n", seen) == ("no newline at the end\n", "")
    assert split_eof_markers("[2] dtrun-rank-eof: rank=2\n", seen) == ("", "") and seen == {"2", "3"}
    assert split_eof_markers("progress 50%\r", set()) == ("progress 50%\r", "")  # prompts are not held


def test_output_cut_short_names_ranks_whose_last_line_never_came():
    from dtrun.launcher.job.supervisor import JobSupervisor as RunningJob, output_cut_short

    class P:
        pid = 1

    job = RunningJob(P())
    job.started_ranks.update({"0": "h1", "1": "h2", "2": "h3"})
    assert output_cut_short(job, {"0", "2"}, succeeded=True) == ["1"]
    job.failures.append(RankFailure("2", "h3", code=3))
    assert output_cut_short(job, {"0"}, succeeded=False) == ["2"]  # only ranks whose exit marker came


def test_ranks_that_went_silent_name_their_host():
    r = JobResult(returncode=255, mpirun_returncode=255, failures=[], vanished=[("1", "node2")])
    assert failure_summary(r).startswith("dtrun: job failed: rank 1 on node2 went silent (no exit report)")


def test_hydra_iface_takes_only_plain_interface_names_from_the_hosts():
    hostile = (("s1", (("eth0;reboot", "10.1.0.11/24"),)), ("s2", (("eth0;reboot", "10.1.0.12/24"),)))
    s = spec(include_iface=("10.1.0.0/24",), host_ifaces=hostile)
    assert "reboot" not in line(build_command(s, HYDRA))


def test_users_own_hydra_iface_in_mpi_args_is_not_doubled():
    ifaces = (("s1", (("eth0", "10.1.0.11/24"),)), ("s2", (("eth0", "10.1.0.12/24"),)))
    s = spec(include_iface=("10.1.0.0/24",), host_ifaces=ifaces, launcher_addr="10.1.0.1",
             mpi_args=("-iface", "ib0", "-localhost", "10.2.0.1"))
    args = build_command(s, HYDRA)
    assert args.count("-iface") == 1 and args.count("-localhost") == 1


def _multi_host_spec(choice=None, shared=None, environ=None, **opts):
    from dtrun.launcher.hosts import HostSelection
    from dtrun.launcher.launch import LaunchOptions, LocalFacts, make_spec
    selection = HostSelection(tuple(parse_host_list("node-a.invalid:2,node-b.invalid:2")), "-H")
    return make_spec(LaunchOptions(program=("true",), **opts), OMPI5, selection, environ or {}, choice,
                     LocalFacts(shared))


def test_make_spec_applies_the_preflight_choice_unless_the_user_chose():
    from dtrun.launcher.netinfo import InterfaceChoice
    choice = InterfaceChoice("10.0.0.0/24", "=eth0", "subnet 10.0.0.0/24 shared by all hosts, found by the preflight")
    s = _multi_host_spec(choice)
    assert s.include_iface == ("10.0.0.0/24",) and s.nccl_socket_ifname == "=eth0"
    assert s.iface_reason == "subnet 10.0.0.0/24 shared by all hosts, found by the preflight"
    mine = _multi_host_spec(choice, exclude_iface="eth9")
    assert mine.include_iface == () and mine.nccl_socket_ifname is None and "eth9 from --exclude-iface" in mine.iface_reason
    same = _multi_host_spec(choice, include_iface="10.0.0.0/24")  # the user's own flag, the same subnet
    assert same.iface_reason == "--include-iface" and same.nccl_socket_ifname == "=eth0"
    other = _multi_host_spec(choice, include_iface="ib0")
    assert other.include_iface == ("ib0",) and other.nccl_socket_ifname is None
    nccl = _multi_host_spec(choice, environ={"NCCL_SOCKET_IFNAME": "ib0"})
    assert nccl.include_iface == ("10.0.0.0/24",) and nccl.nccl_socket_ifname is None
    from dtrun.launcher.netinfo import SharedSubnet
    guessed = _multi_host_spec(None, SharedSubnet("eth1", "10.9.0.0/16"))
    assert guessed.include_iface == ("10.9.0.0/16",) and "inferred on this machine" in guessed.iface_reason
    assert _multi_host_spec(choice, SharedSubnet("eth1", "10.9.0.0/16")).include_iface == ("10.0.0.0/24",)


def test_make_spec_is_pure_no_dns_no_ip_no_files(monkeypatch, tmp_path):
    """Hosts that do not resolve, a cluster file's per-host ssh settings, and every way out of
    the process closed: the spec is still built, and nothing was written."""
    import socket
    import subprocess

    from dtrun.launcher.hostfile import HostSlots
    from dtrun.launcher.hosts import HostSelection
    from dtrun.launcher.launch import LaunchOptions, make_spec

    def refuse(*a, **k):
        raise AssertionError(f"make_spec reached outside the process: {a[:1]}")

    for mod, name in ((socket, "getaddrinfo"), (socket, "gethostbyname"), (subprocess, "run"),
                      (subprocess, "Popen"), (os, "replace"), (os, "mkdir")):
        monkeypatch.setattr(mod, name, refuse)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    hosts = (HostSlots("node-a.invalid", 2, user="ops", port=2222), HostSlots("node-b.invalid", 2))
    spec = make_spec(LaunchOptions(program=("true",)), OMPI5, HostSelection(hosts, "cluster.yaml"), {})
    assert spec.include_iface == () and spec.iface_reason == "default"
    assert spec.ssh_files and spec.ssh_config == spec.ssh_files[0].path
    assert "Port 2222" in spec.ssh_files[0].text
    assert list(tmp_path.iterdir()) == []  # described, not written


def test_users_own_pml_or_btl_replaces_dtruns_and_is_given_once():
    # Open MPI stops with "MCA parameters can only be listed once on a command line" when a
    # parameter appears twice, so the user's own choice must replace dtrun's, not follow it.
    for flavor in (OMPI4, OMPI5):
        argv = build_command(spec(mca=(("btl", "self,tcp"),)), flavor)
        pairs = [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == "--mca"]
        assert [v for k, v in pairs if k == "btl"] == ["self,tcp"], argv
        assert ("pml", "ob1") in pairs
        argv = build_command(spec(mca=(("pml", "ucx"),)), flavor)
        pairs = [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == "--mca"]
        assert [v for k, v in pairs if k == "pml"] == ["ucx"], argv
        assert [k for k, v in pairs if k == "btl"] == ["btl"]


def test_a_coll_tuned_variable_in_the_shell_keeps_the_allreduce_rules_off():
    from tests.dtrun_helpers import dtrun, user_env

    argv = ("--dry-run", "--no-preflight", "-np", "2", "-H", "server1:1,server2:1", "python", "x.py")
    assert COLL_RULES in dtrun(*argv, timeout=60).stdout
    p = dtrun(*argv, timeout=60, env=user_env(OMPI_MCA_coll_tuned_bcast_algorithm="3"))
    assert p.returncode == 0 and "mpirun_cmd=(" in p.stdout and "coll_tuned" not in p.stdout, p.stdout + p.stderr


def test_allreduce_rules_left_out_where_the_install_path_is_not_one_word(monkeypatch):
    # Open MPI splits some MCA values on spaces itself: a path it could split is never passed.
    from dtrun.launcher import command

    monkeypatch.setattr(command, "COLL_RULES", "/opt/my dtrun/launcher/remote/ompi_coll_rules.conf")
    text = line(build_command(spec(), OMPI5))
    assert "coll_tuned" not in text and "--mca pml ob1" in text


def test_the_end_of_a_long_jobs_stdout_is_kept_for_the_reports_at_its_end():
    """Open MPI 5 reports a lost daemon's exit status on stdout when the job ends, after all of
    the job's own output: it must be read from stdout's end, not only its first 64 KiB."""
    import subprocess as sp
    import sys as _sys

    from dtrun.launcher.job import parsers, pumps

    report = "  Local host:    vm\n  Remote host:   node-h2\n  Daemon exit status: 255\n"
    code = (f"import sys\nfor i in range(4000):\n    sys.stdout.write('%06d %s\\n' % (i, 'x' * 90))\n"
            f"sys.stdout.write({report!r})\n")
    proc = sp.Popen([_sys.executable, "-c", code], stdout=sp.PIPE, stderr=sp.PIPE)
    p = pumps.OutputPumps(proc, (), pumps.PumpHooks(lambda f: None, lambda r, h: None, lambda: None))
    with open(os.devnull, "w") as null:
        saved, _sys.stdout = _sys.stdout, null
        try:
            p.start()
            proc.wait(timeout=60)
            p.join(30, drain=True)
        finally:
            _sys.stdout = saved
    tail = p.stdout_tail_text()
    assert tail.endswith(report) and len(tail) < 200_000
    assert report not in "".join(p.stdout_head)  # past the first 64 KiB
    assert parsers.dropped_daemon_host(tail, ["node-h2"]) == "node-h2"
