"""The pure parts of launching under Slurm: launcher choice, the srun command, rank
variables, the allocation watch. The real Slurm runs are in tests/test_slurm.py."""
import os
import threading

import pytest

from dtrun.launcher import allocwatch, slurm
from dtrun.launcher import command as cmd
from dtrun.launcher.errors import UsageError
from dtrun.launcher.flavors import MPICH, OPENMPI, Flavor
from dtrun.launcher.hosts import resolve_hosts
from dtrun.launcher.launch import LaunchOptions, make_spec
from dtrun.launcher.remote.rankexec import rank_env
from dtrun.launcher.job.result import JobResult, RankFailure, StopReason, StopState

OMPI5 = Flavor(OPENMPI, (5, 0, 11), "/venv/bin/mpirun", "/venv")
OMPI4 = Flavor(OPENMPI, (4, 1, 4), "/usr/bin/mpirun.openmpi", "/usr")
MPICH4 = Flavor(MPICH, (4, 0, 2), "/usr/bin/mpiexec.mpich", "/usr")
LIST_2205 = ("MPI plugin types are...\n\tpmix\n\tnone\n\tcray_shasta\n\tpmi2\n"
             "specific pmix plugin versions available: pmix_v4\n")
ALLOC = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x3)"}


def test_mpi_list_of_slurm_22_05():
    assert slurm.parse_mpi_list(LIST_2205) == ("pmix", "none", "cray_shasta", "pmi2", "pmix_v4")


@pytest.mark.parametrize("flavor,plugins,expected", [
    (OMPI5, ("pmix", "pmi2"), "pmix"),
    (OMPI4, ("pmi2", "pmix_v4"), "pmix_v4"),  # a site that built only the versioned plugin
    (MPICH4, ("pmix", "pmi2"), "pmi2"),
    (MPICH4, ("pmix", "none"), None),  # Debian's MPICH speaks PMI, not PMIx
    (OMPI5, ("pmi2", "none"), None),  # Open MPI 5 speaks only PMIx
])
def test_plugin_each_mpi_needs(flavor, plugins, expected):
    assert slurm.plugin_for(flavor, plugins) == expected


def test_leftover_nodelist_is_no_allocation():
    assert slurm.current_allocation({"SLURM_JOB_NODELIST": "n[1-3]"}) is None
    assert slurm.current_allocation(dict(ALLOC, SLURM_CPUS_PER_TASK="4")) == slurm.Allocation("42", 4)
    with pytest.raises(UsageError, match="SLURM_CPUS_PER_TASK='x' is not a positive integer"):
        slurm.current_allocation(dict(ALLOC, SLURM_CPUS_PER_TASK="x"))


@pytest.fixture
def srun_on_path(tmp_path):
    exe = tmp_path / "srun"
    exe.write_text("#!/bin/sh\nexit 1\n")  # found on PATH; the plugin list is given to choose_launcher
    exe.chmod(0o755)
    return dict(ALLOC, PATH=str(tmp_path))


def test_auto_takes_srun_inside_an_allocation(srun_on_path):
    choice = slurm.choose_launcher("auto", OMPI5, True, srun_on_path, plugins_of=lambda s: ("pmix", "pmi2"))
    assert (choice.launcher, choice.reason, choice.allocation.job_id) == ("srun", "inside an allocation, and srun has the plugin this MPI needs", "42")


def test_auto_keeps_mpirun_where_srun_cannot(srun_on_path):
    outside = slurm.choose_launcher("auto", OMPI5, False, {"PATH": srun_on_path["PATH"]})
    assert (outside.launcher, outside.reason) == ("mpirun", "not inside a Slurm allocation")
    given_hosts = slurm.choose_launcher("auto", OMPI5, False, srun_on_path, plugins_of=lambda s: ("pmix",))
    assert given_hosts.launcher == "mpirun" and "hosts given on the command line" in given_hosts.reason
    no_plugin = slurm.choose_launcher("auto", MPICH4, True, srun_on_path, plugins_of=lambda s: ("pmix",))
    assert no_plugin.launcher == "mpirun"
    assert no_plugin.reason == "MPICH (Hydra) 4.0.2 needs srun --mpi=pmi2; this Slurm offers pmix"


@pytest.mark.parametrize("env_extra,from_slurm,message", [
    ({"SLURM_JOB_ID": ""}, True, "--launcher srun needs a Slurm allocation"),
    ({}, False, "--launcher srun starts ranks on the allocation's nodes: drop -H/--hostfile/--cluster"),
])
def test_launcher_srun_where_it_cannot_work_is_a_usage_error(srun_on_path, env_extra, from_slurm, message):
    with pytest.raises(UsageError, match=message.replace("-", r"\-")):
        slurm.choose_launcher("srun", OMPI5, from_slurm, dict(srun_on_path, **env_extra),
                              plugins_of=lambda s: ("pmix",))
    with pytest.raises(UsageError, match="choose one of auto, srun, mpirun"):
        slurm.choose_launcher("ssh", OMPI5, True, srun_on_path)


def _spec(flavor, np=None, **opts):
    selection = resolve_hosts(environ=ALLOC)
    return make_spec(LaunchOptions(program=("/bin/prog", "a b"), np=np, **opts), flavor, selection,
                     {"PATH": "/usr/bin"})


def test_srun_command_for_open_mpi_5():
    spec = _spec(OMPI5, np=3, exclude_iface="lo,docker0", env=("TOKEN=s3cret", "HOME"))
    argv = [a for g in slurm.build_srun_groups(spec, OMPI5, ("pmix", "pmi2"), cpus_per_task=2, srun="/usr/bin/srun")
            for a in g.args]
    wrapper = list(spec.rank_wrapper)
    assert argv == ["env", "OMPI_MCA_pml=ob1", "OMPI_MCA_btl=self,sm,tcp", "OMPI_MCA_osc=^ucx",
                    "OMPI_MCA_coll_tuned_use_dynamic_rules=1",
                    f"OMPI_MCA_coll_tuned_dynamic_rules_filename={cmd.COLL_RULES}",
                    "OMPI_MCA_btl_tcp_if_exclude=lo,docker0", "SLURM_PMIX_FENCE=ring",
                    "NCCL_SOCKET_IFNAME=^lo,docker0", "MASTER_ADDR=n1", f"MASTER_PORT={spec.master_port}",
                    "TOKEN=s3cret", "/usr/bin/srun", "--ntasks=3", "--nodes=2", "--nodelist=n1,n2", "--mpi=pmix",
                    "--kill-on-bad-exit=1", "--cpus-per-task=2", "--export=ALL", "--label",
                    *wrapper, "/bin/prog", "a b"]


def test_srun_command_for_mpich_and_its_notes():
    spec = _spec(MPICH4, include_iface="eth1", no_tree_spawn=True)
    groups = slurm.build_srun_groups(spec, MPICH4, ("pmix", "pmi2"))
    argv = [a for g in groups for a in g.args]
    assert argv[:2] == ["env", "NCCL_SOCKET_IFNAME=eth1"]
    assert "--mpi=pmi2" in argv and "--ntasks=6" in argv and "--nodelist=n1,n2,n3" in argv
    assert not any(a.startswith("OMPI_MCA") for a in argv)
    notes = slurm.srun_notes(spec, MPICH4)
    assert notes[0] == "--no-tree-spawn has no effect under srun: there are no MPI daemons to spawn"
    assert "eth1 is not passed" in notes[1]
    with pytest.raises(UsageError, match=r"MPICH \(Hydra\) 4.0.2 needs srun --mpi=pmi2; this Slurm offers pmix"):
        slurm.build_srun_groups(spec, MPICH4, ("pmix",))


def test_mca_becomes_an_environment_variable_under_srun():
    spec = _spec(OMPI4, mca=(("coll_tuned_use_dynamic_rules", "1"),))
    argv = [a for g in slurm.build_srun_groups(spec, OMPI4, ("pmix",)) for a in g.args]
    assert "OMPI_MCA_coll_tuned_use_dynamic_rules=1" in argv and "OMPI_MCA_btl=self,vader,tcp" in argv
    # The name becomes part of a variable name: the one gate (launcher/safe.py) refuses it first.
    with pytest.raises(UsageError, match="--mca: invalid parameter name 'a b'"):
        _spec(OMPI4, mca=(("a b", "1"),))


def test_open_mpi_gets_the_ring_fence_on_more_than_one_node():
    """Slurm 22.05's tree fence does not wait for the other nodes (launcher/slurm.py PMIX_FENCE_WHY)."""
    groups = slurm.build_srun_groups(_spec(OMPI4), OMPI4, ("pmix",))
    assert [g.why for g in groups if "SLURM_PMIX_FENCE=ring" in g.args] == [slurm.PMIX_FENCE_WHY]
    assert "TreeWidth" in slurm.cmd.format_dry_run(groups)
    argv = [a for g in groups for a in g.args]
    assert argv.index("SLURM_PMIX_FENCE=ring") < argv.index("srun")  # in srun's environment, as --export=ALL hands on

    def fence_args(spec, flavor):
        return [a for g in slurm.build_srun_groups(spec, flavor, ("pmix", "pmi2")) for a in g.args
                if a.startswith("SLURM_PMIX_FENCE")]
    assert fence_args(_spec(OMPI4, np=2), OMPI4) == []  # one node: nothing to wait for
    assert fence_args(_spec(OMPI4, env=("SLURM_PMIX_FENCE=tree",)), OMPI4) == ["SLURM_PMIX_FENCE=tree"]
    assert fence_args(_spec(OMPI5), OMPI5) == ["SLURM_PMIX_FENCE=ring"]
    assert fence_args(_spec(MPICH4), MPICH4) == []  # pmi2: not this fence


def test_secret_values_are_hidden_in_the_dry_run():
    spec = _spec(OMPI5, env=("API_TOKEN=s3cret",))
    text = slurm.cmd.format_dry_run(slurm.build_srun_groups(spec, OMPI5, ("pmix",)))
    assert "s3cret" not in text and "API_TOKEN=" in text


# Variables seen in tasks of `srun -N2 -n3` on Slurm 22.05 (second node, its second task).
SRUN_TASK = {"SLURM_PROCID": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "3",
             "SLURM_STEP_TASKS_PER_NODE": "1,2", "SLURM_NTASKS": "3"}


@pytest.mark.parametrize("plugin_vars", [{"PMI_RANK": "2", "PMI_SIZE": "3"}, {"PMIX_RANK": "2"}, {}])
def test_rank_variables_right_under_srun(plugin_vars):
    assert rank_env(dict(SRUN_TASK, **plugin_vars)) == {
        "DTRUN_RANK": "2", "DTRUN_LOCAL_RANK": "1", "DTRUN_SIZE": "3", "DTRUN_LOCAL_SIZE": "2"}


def test_rank_variables_under_mpirun_inside_an_allocation():
    # Open MPI's daemons were started by srun: SLURM_PROCID is the daemon's, not the rank's.
    env = dict(SRUN_TASK, OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_COMM_WORLD_SIZE="6", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    assert rank_env(env)["DTRUN_RANK"] == "5"
    compressed = dict(SRUN_TASK, SLURM_NODEID="3", SLURM_STEP_TASKS_PER_NODE="2(x3),1", SLURM_STEP_NUM_TASKS="7")
    assert rank_env(compressed)["DTRUN_LOCAL_SIZE"] == "1"


@pytest.mark.parametrize("rc,out,err,expected", [
    (0, "RUNNING\n", "", "RUNNING"),
    (0, "COMPLETING\n", "", "COMPLETING"),
    (0, "", "", allocwatch.GONE),
    (1, "", "slurm_load_jobs error: Invalid job id specified\n", allocwatch.GONE),
    (1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n", None),
])
def test_squeue_answers(rc, out, err, expected):
    assert allocwatch.parse_squeue(rc, out, err) == expected


def test_watcher_stops_once_when_the_job_ends_and_not_on_a_failed_query():
    answers = iter([None, "RUNNING", "CANCELLED", "CANCELLED"])
    gone = threading.Event()
    calls = []

    def on_gone():
        calls.append(1)
        gone.set()

    stop = allocwatch.watch_allocation("42", {"DTRUN_SLURM_POLL_S": "0.01"}, on_gone=on_gone,
                                       state_of=lambda jid: next(answers))
    assert gone.wait(5)
    stop()
    assert calls == [1]


def test_exit_code_is_the_first_failing_rank_not_srun_highest():
    result = JobResult(returncode=143, mpirun_returncode=143, failures=[RankFailure("1", "n2", code=3), RankFailure("0", "n1", signum=15)])
    assert slurm.srun_exit_code(result) == 3
    assert slurm.srun_exit_code(JobResult(returncode=130, mpirun_returncode=1, failures=[],
                                            stops=[StopState(StopReason.SIGNAL, "stopped by SIGINT", 2)])) == 130
