"""Pure logic of the env, GPU and end-to-end checks, and the tree-spawn pairs, on values."""
import pytest

from dtrun.checks import e2e, env, gpu
from dtrun.checks.treespawn import radix_parent, ssh_pair_findings, tree_spawn_pairs
from dtrun.checks.result import FAIL, NA, OK, WARN, Finding, worst

VENV = "/opt/venv/bin"
LOCAL = env.LocalFacts(
    mpi_kind="openmpi", mpi_version=(5, 0, 11), mpi_label="Open MPI 5.0.11", mpirun=f"{VENV}/mpirun",
    daemon="prted", daemon_path=f"{VENV}/prted", python=f"{VENV}/python", python_version="3.11.7",
    mpi4py="4.1.2", path=f"{VENV}:/usr/bin:/bin", ld_library_path=None, cwd="/work", program=None)


def present(isdir=False):
    return {"exists": True, "exec": True, "isdir": isdir, "sig": None}


def healthy(**over):
    """A probe report from a host set up like this one."""
    rep = {
        "hostname": "h1",
        "env": {"PATH": f"{VENV}:/usr/bin:/bin", "LD_LIBRARY_PATH": "/usr/local/lib"},
        "which": {"mpirun": f"{VENV}/mpirun", "mpiexec": f"{VENV}/mpiexec", "prted": f"{VENV}/prted",
                  "python3": f"{VENV}/python3"},
        "paths": {"python": present(), "cwd": present(True), "mpirun": present(), "daemon": present()},
        "versions": {f"{VENV}/mpirun": None},
        "python": {"executable": f"{VENV}/python", "version": "3.11.7", "is_job_python": True, "mpi4py": "4.1.2",
                   "mpi_library": "Open MPI v5.0.11"},
    }
    for key, value in over.items():
        rep[key] = {**rep[key], **value} if isinstance(value, dict) else value
    return rep


def statuses(found):
    return [(f.status, f.check) for f in found]


def test_healthy_host_is_one_ok():
    found = env.env_findings("h1", healthy(), LOCAL)
    assert statuses(found) == [(OK, "env")]
    assert found[0].detail == "Open MPI 5.0.11, prted on PATH; Python 3.11.7 with mpi4py 4.1.2; /work present"


def test_path_without_the_mpi_warns_when_dtrun_still_finds_the_daemon():
    rep = healthy(env={"PATH": "/usr/bin:/bin"}, which={"mpirun": None, "mpiexec": None, "prted": None})
    [f] = env.env_findings("h3", rep, LOCAL)
    assert f.status == WARN
    assert "prted is not on h3's non-interactive PATH (/usr/bin:/bin)" in f.detail
    assert f"finds prted at {VENV}/prted" in f.detail and f"put {VENV} on PATH" in f.fix


def test_daemon_nowhere_fails():
    rep = healthy(which={"prted": None}, paths={"daemon": {"exists": False, "exec": False}})
    [f] = env.env_findings("h3", rep, LOCAL)
    assert f.status == FAIL and "neither on h3's non-interactive PATH" in f.detail


def test_other_mpi_first_on_path_names_both_versions():
    other = "/opt/other/bin/mpirun"
    rep = healthy(which={"mpirun": other}, versions={other: "mpirun (Open MPI) 4.1.4\n"})
    [f] = env.env_findings("h5", rep, LOCAL)
    assert f.status == WARN
    assert f"is Open MPI 4.1.4 ({other}); this host launches Open MPI 5.0.11 ({VENV}/mpirun)" in f.detail


def test_different_mpi_at_the_launch_path_fails():
    rep = healthy(versions={f"{VENV}/mpirun": "mpirun (Open MPI) 5.0.3\n"})
    [f] = env.env_findings("h2", rep, LOCAL)
    assert f.status == FAIL and "is Open MPI 5.0.3; on this host it is Open MPI 5.0.11" in f.detail


def test_missing_mpi_install_fails():
    rep = healthy(paths={"mpirun": {"exists": False, "exec": False}})
    assert FAIL in [f.status for f in env.env_findings("h2", rep, LOCAL)]


def test_python_missing_or_different_or_without_mpi4py():
    gone = healthy(paths={"python": {"exists": False, "exec": False}}, python={"is_job_python": False})
    [f] = env.env_findings("h2", gone, LOCAL)
    assert f.status == FAIL and f"{VENV}/python (Python 3.11.7" in f.detail
    old = healthy(python={"version": "3.10.12"})
    [f] = env.env_findings("h2", old, LOCAL)
    assert "Python 3.10.12; here it is 3.11.7" in f.detail
    broken = healthy(python={"mpi4py": None, "mpi4py_error": "OSError: libmpi.so.40: cannot open shared object file"})
    [f] = env.env_findings("h2", broken, LOCAL)
    assert f.status == FAIL and "LD_LIBRARY_PATH there: /usr/local/lib; here: unset" in f.detail


def test_ld_library_path_missing_entries_compared_with_this_host():
    local = env.LocalFacts(**{**LOCAL.__dict__, "ld_library_path": "/usr/local/cuda/lib64"})
    [f] = env.env_findings("h4", healthy(env={"LD_LIBRARY_PATH": None}), local)
    assert f.status == WARN and "is unset; here it is /usr/local/cuda/lib64" in f.detail


def test_ld_library_path_odd_one_out_between_hosts():
    reps = {"h1": healthy(), "h2": healthy(), "h4": healthy(env={"LD_LIBRARY_PATH": None})}
    [f] = env.consistency_findings(reps, LOCAL)
    assert f.host == "h4" and f.status == WARN
    assert f.detail.startswith("LD_LIBRARY_PATH in a non-interactive shell on h4 is unset; on h1, h2 it is /usr/local/lib")
    assert env.consistency_findings({"h1": healthy(), "h2": healthy()}, LOCAL) == []


def test_missing_cwd_and_program():
    local = env.LocalFacts(**{**LOCAL.__dict__, "program": "/work/train.py"})
    rep = healthy(paths={"cwd": {"exists": False, "isdir": False}, "program": {"exists": False}})
    found = env.env_findings("h5", rep, local)
    assert [f.status for f in found] == [FAIL, FAIL]
    assert "the working directory /work does not exist on h5" in found[0].detail
    assert found[1].detail == "the program /work/train.py does not exist on h5"
    assert "rsync -a /work/train.py h5:/work/train.py" in found[1].fix


def test_probe_error_is_a_failure():
    [f] = env.env_findings("h2", {"error": "PermissionError: x"}, LOCAL)
    assert f.status == FAIL and "PermissionError" in f.detail


def test_daemon_names():
    assert env.daemon_name("openmpi", 5) == "prted"
    assert env.daemon_name("openmpi", 4) == "orted"
    assert env.daemon_name("mpich", 4) == "hydra_pmi_proxy"


# nvidia-smi output captured from real machines: this machine has no GPU, so the parser is
# tested on text, and the real path (no nvidia-smi) is checked to be "not applicable".
SMI_H100 = """0, NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB
1, NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB
"""
SMI_A100 = "0, NVIDIA A100-SXM4-40GB, 535.129.03, 40960 MiB\n"


def test_parse_nvidia_smi():
    assert gpu.parse_nvidia_smi(SMI_H100 + "garbage line\n") == [
        gpu.Gpu(0, "NVIDIA H100 80GB HBM3", "550.54.15", "81559 MiB"),
        gpu.Gpu(1, "NVIDIA H100 80GB HBM3", "550.54.15", "81559 MiB")]


def smi(text, rc=0, nccl=("/usr/lib/x86_64-linux-gnu/libnccl.so.2",)):
    return {"gpu": {"nvidia_smi": "/usr/bin/nvidia-smi", "rc": rc, "query": text, "nccl": list(nccl)}}


def test_gpu_findings():
    hosts = [gpu.host_gpus("h1", 2, smi(SMI_H100)), gpu.host_gpus("h2", 4, smi(SMI_H100)),
             gpu.host_gpus("h3", 1, smi(SMI_A100, nccl=())), gpu.host_gpus("h4", 2, {"gpu": {"nvidia_smi": None}})]
    found = gpu.gpu_findings(hosts)
    by = {h: [f for f in found if f.host == h] for h in ("h1", "h2", "h3", "h4")}
    assert statuses(by["h1"]) == [(OK, "gpu")]
    assert by["h1"][0].detail.startswith("2× NVIDIA H100 80GB HBM3, driver 550.54.15, NCCL")
    assert "2 GPUs for 4 slots" in by["h2"][0].detail
    h3 = " ".join(f.detail for f in by["h3"])
    assert "driver 535.129.03 while h1, h2 run 550.54.15" in h3 and "no libnccl.so" in h3
    assert by["h4"][0].status == WARN and "other hosts have GPUs" in by["h4"][0].detail


# The gpu part of launcher/remote/probe.py's report, run on a real H100 machine (captured once).
H100_PROBE = {"gpu": {
    "nvidia_smi": "/usr/local/nvidia/bin/nvidia-smi", "rc": 0,
    "query": "0, NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\n",
    "nccl": ["/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
             "/usr/lib/x86_64-linux-gnu/libnccl.so.2"]}}


def test_gpu_findings_on_a_probe_report_captured_on_an_h100():
    one, two = gpu.gpu_findings([gpu.host_gpus("g1", 1, H100_PROBE), gpu.host_gpus("g2", 2, H100_PROBE)])
    assert one.status == OK and one.detail.startswith("1× NVIDIA H100 80GB HBM3, driver 580.159.04, NCCL /opt/torch")
    assert two.status == WARN and "1 GPU for 2 slots" in two.detail and two.fix == "give g2 at most 1 slot"


def test_no_gpus_anywhere_is_not_applicable():
    found = gpu.gpu_findings([gpu.host_gpus("h1", 1, {"gpu": {"nvidia_smi": None}})])
    assert statuses(found) == [(NA, "gpu")]


def test_nvidia_smi_failure():
    [f] = gpu.gpu_findings([gpu.host_gpus("h1", 1, smi("NVIDIA-SMI has failed because it couldn't communicate "
                                                       "with the NVIDIA driver.", rc=9))])
    assert f.status == FAIL and "couldn't communicate" in f.detail


def test_tree_spawn_pairs():
    hosts = [f"n{i}" for i in range(1, 201)]
    assert tree_spawn_pairs(hosts[:64], 64) == []
    # PRRTE's routed/radix: daemon v of a level of L daemons starts v+L, v+2L, ... (interleaved).
    pairs = tree_spawn_pairs(hosts[:70], 64)
    assert pairs == [(f"n{i - 64}", f"n{i}") for i in range(65, 71)]
    big = tree_spawn_pairs(hosts, 64)
    assert ("n1", "n65") in big and ("n1", "n129") in big and ("n8", "n200") in big and len(big) == 200 - 64
    assert tree_spawn_pairs(hosts[:6], 2) == [("n1", "n3"), ("n1", "n5"), ("n2", "n4"), ("n2", "n6")]
    assert [radix_parent(v, 64) for v in (0, 1, 64, 65, 66, 128, 129, 4160, 4161)] == [-1, 0, 0, 1, 2, 64, 1, 64, 65]
    # This host in the list is daemon 0; its ssh is the ssh check itself.
    assert tree_spawn_pairs(["localhost"] + hosts[:65], 64, launcher_in_list=True) == [("n1", "n65")]


def test_ssh_pair_findings():
    res = {"n1": {"n65": [0, 0.4, ""], "n66": [255, 0.1, "Host key verification failed."]}, "n2": {}}
    [f] = ssh_pair_findings(res, "70 hosts: tree spawn", False)
    assert f.status == FAIL and f.host == "n1" and "n1 → n66: Host key verification failed." in f.detail
    assert "--no-tree-spawn" in f.fix and "plm_ssh_no_tree_spawn 1" in f.fix


def test_e2e_markers_and_stages():
    names = {"node-a": "h1", "node-b": "h2"}
    assert e2e.parse_marker("[1,0]<stdout>: DTRUN-E2E init node-a 0 100.5", names) == ("init", "h1", 100.5)
    assert e2e.parse_marker("unrelated", names) is None
    run = e2e.JobRun(("h1", "h2"), t0=100.0, returncode=None,
                     seen={"started": {"h1": 100.5, "h2": 100.7}, "init": {"h1": 101.0}})
    times, stage, missing = e2e.stage_report(run)
    assert times == {"started": 0.7} and stage == "init" and missing == ["h2"]
    ok = e2e.JobRun(("h1",), t0=0.0, returncode=0, seen={s: {"h1": float(i + 1)} for i, s in enumerate(e2e.STAGES)})
    assert e2e.stage_report(ok) == ({"started": 1.0, "init": 1.0, "collective": 1.0, "smoke": 1.0}, None, [])


def test_e2e_blame_and_argv():
    assert e2e.blame([("h1", "h2", None), ("h1", "h3", "init"), ("h2", "h3", "collective")]) == ["h3"]
    assert e2e.blame([("h1", "h2", None)]) == []
    argv = e2e.job_argv(["a", "b"], "/cfg", "10.0.0.0/24", python="/py")
    assert argv == ["/py", "-m", "launcher", "--no-preflight", "-H", "a:1,b:1", "--ssh-config", "/cfg",
                    "--include-iface", "10.0.0.0/24", "/py", "-u", e2e.JOB, "--smoke"]


def test_finding_and_worst():
    assert worst(["ok", "na", "warn"]) == "warn" and worst([]) == "na"
    assert Finding("h1", "ssh", FAIL, "refused", "start sshd").message == "h1: refused; fix: start sshd"
    with pytest.raises(ValueError):
        Finding("h1", "ssh", "bad", "x")


def test_stale_session_dirs_warn_with_a_removal_command_that_quotes_each_path():
    """Paths come from the remote host's TMPDIR: spaces, quotes and shell characters stay one word."""
    import shlex

    odd = ["/tmp/a b/prted.5", "/tmp/x'y;rm -rf ~/prted.6", "/tmp/$(id)/ompi.7"]
    rep = healthy()
    rep["stale_sessions"] = {"count": 25, "paths": odd}
    [f] = env.env_findings("h2", rep, LOCAL)
    assert f.status == WARN
    assert f.detail.startswith("25 session directories of killed Open MPI 5 jobs on h2 (/tmp/a b/prted.5, ")
    assert "'Daemon exit status: 213'" in f.detail
    command, _, rest = f.fix.partition("to remove them now: ")[2].partition(" (the first")
    assert shlex.split(command) == ["ssh", "h2", "rm", "-rf", *odd]
    assert rest == " 3 of 25)"
    rep["stale_sessions"] = {"count": 0, "paths": []}
    assert statuses(env.env_findings("h2", rep, LOCAL)) == [(OK, "env")]
