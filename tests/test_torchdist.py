"""Scripts written for torch.distributed (env:// rendezvous) under dtrun, unchanged:
the variables dtrun exports, how MASTER_ADDR/MASTER_PORT are chosen, GPU pinning, and
real gloo jobs on this machine and across namespace hosts."""
from __future__ import annotations

import random

import pytest

from dtrun.launcher.remote import rankexec
from dtrun.launcher.errors import UsageError
from dtrun.launcher.hostfile import HostSlots
from dtrun.launcher.rendezvous import REMOTE_PORT_RANGE, choose, master_addr, remote_port
from tests.dtrun_helpers import PYTHON, REPO, dtrun, result_records

SCRIPT = str(REPO / "tests" / "torchdist_env.py")


def hs(*names):
    return tuple(HostSlots(n, 2) for n in names)


def results(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = result_records(proc.stdout)
    return sorted(found, key=lambda r: r["rank"])


# ----------------------------------------------------------------------------- pure parts
def test_master_addr_is_rank0_host():
    local = {"localhost", "me"}.__contains__
    assert master_addr(hs("localhost"), True, local, "me") == "127.0.0.1"
    assert master_addr(hs("node1", "node2"), False, local, "me") == "node1"
    assert master_addr(hs("localhost", "node2"), False, local, "me") == "me"  # reachable from node2
    assert master_addr(hs("me", "node2"), False, local, "me") == "me"


def test_port_free_here_when_rank0_is_local_else_random_high():
    addr, port = choose(hs("localhost"), True, {}, {})
    assert addr == "127.0.0.1" and 1024 <= port <= 65535
    addr, port = choose(hs("node1", "node2"), False, {}, {})
    assert addr == "node1" and REMOTE_PORT_RANGE[0] <= port <= REMOTE_PORT_RANGE[1]
    ports = {remote_port(random.Random(s)) for s in range(20)}
    assert len(ports) > 10 and all(20000 <= p <= 32767 for p in ports)


def test_user_values_win_and_are_checked():
    assert choose(hs("node1"), False, {}, {"MASTER_PORT": "29500"}) == ("node1", 29500)
    assert choose(hs("node1"), False, {"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "1234"}, {}) == ("10.0.0.9", 1234)
    assert choose(hs("node1"), False, {"MASTER_PORT": "1234"}, {"MASTER_PORT": None}) == ("node1", 1234)
    with pytest.raises(UsageError, match="MASTER_PORT 'http' is not a port number"):
        choose(hs("node1"), False, {}, {"MASTER_PORT": "http"})
    with pytest.raises(UsageError, match="MASTER_ADDR 'a b' is not a host name"):
        choose(hs("node1"), False, {}, {"MASTER_ADDR": "a b"})


def test_rank_wrapper_exports_torchrun_names_and_pins_gpus(tmp_path):
    env = rankexec.rank_env({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                             "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert rankexec.torch_env(env) == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    # No GPU on this machine: the device files are made here (the one part that is faked).
    for i in range(2):
        (tmp_path / f"nvidia{i}").write_text("")
    (tmp_path / "nvidiactl").write_text("")
    assert rankexec.pinned_gpu({}, "3", dev_dir=str(tmp_path)) == "1"
    assert rankexec.pinned_gpu({"CUDA_VISIBLE_DEVICES": "4,6,7"}, "4", dev_dir=str(tmp_path)) == "6"
    assert rankexec.pinned_gpu({}, "2", dev_dir=str(tmp_path / "none")) == "2"


def test_dry_run_shows_rendezvous_and_pinning():
    p = dtrun("--dry-run", "-np", "2", "-H", "localhost:2", "--pin-gpus", "-x", "MASTER_PORT=29400", "python", "t.py")
    assert p.returncode == 0, p.stderr
    assert "-x MASTER_ADDR=127.0.0.1" in p.stdout and "-x MASTER_PORT=29400" in p.stdout
    assert "-x DTRUN_GPU_PER_RANK=1" in p.stdout
    p = dtrun("--dry-run", "-np", "2", "-H", "localhost:2", "-x", "MASTER_PORT=http", "python", "t.py")
    assert p.returncode == 2 and "MASTER_PORT 'http' is not a port number" in p.stderr


# ----------------------------------------------------------------------------- real jobs
@pytest.mark.mpi
def test_env_init_script_runs_unchanged_with_gloo():
    pytest.importorskip("torch", reason="PyTorch is not installed")
    res = results(dtrun("-np", "2", "-H", "localhost:2", "--pin-gpus", PYTHON, SCRIPT, timeout=120))
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r["size"] == 2 and r["sum"] == 3.0  # gloo allreduce over the env:// rendezvous
        assert r["grad"] == res[0]["grad"]  # DDP averaged the gradients
        e = r["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (str(r["rank"]), str(r["rank"]), "2", "2")
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["MASTER_PORT"] == res[0]["env"]["MASTER_PORT"]
        assert e["CUDA_VISIBLE_DEVICES"] == str(r["rank"])


@pytest.mark.cluster
@pytest.mark.mpi
def test_env_init_script_across_hosts(cluster3):
    pytest.importorskip("torch", reason="PyTorch is not installed")
    names = [h.name for h in cluster3.hosts]
    hl = ",".join(f"{n}:{k}" for n, k in zip(names, [1, 2, 1]))
    p = dtrun("--ssh-config", cluster3.ssh_config, "-H", hl, PYTHON, SCRIPT, timeout=120)
    res = results(p)
    assert [r["rank"] for r in res] == [0, 1, 2, 3]
    assert [r["host"] for r in res] == [names[0], names[1], names[1], names[2]]
    for r in res:
        assert r["size"] == 4 and r["sum"] == 10.0 and r["grad"] == res[0]["grad"]
        assert r["env"]["MASTER_ADDR"] == names[0]  # rank 0's host
        assert r["env"]["LOCAL_RANK"] == ("1" if r["rank"] == 2 else "0")
        assert r["env"]["LOCAL_WORLD_SIZE"] == ("2" if r["host"] == names[1] else "1")
    port = int(res[0]["env"]["MASTER_PORT"])
    assert 20000 <= port <= 32767 and {r["env"]["MASTER_PORT"] for r in res} == {str(port)}
