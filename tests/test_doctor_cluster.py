"""dtrun doctor, keyscan and the launch preflight on namespace clusters: real sshd, real faults.

Each fault is injected on one host; doctor must name that host and that cause, and
nothing on the healthy hosts. Faults that do not interfere share one cluster to keep
the time down (tests/nscluster/ makes the hosts; see docs/cluster-testing.md).
"""
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dtrun.checks import e2e
from tests.cluster_plugin import skip_if_unavailable
from tests.dtrun_helpers import DTRUN, dtrun, user_env
from tests.nscluster import Cluster

pytestmark = pytest.mark.cluster


def run_doctor(cluster, *args, timeout=120, env=None):
    t0 = time.monotonic()
    p = dtrun("doctor", "--ssh-config", cluster.ssh_config, "--hostfile", cluster.hostfile, *args,
              timeout=timeout, env=env)
    return p, time.monotonic() - t0


def doctor_json(cluster, *args, **kw):
    p, elapsed = run_doctor(cluster, "--json", *args, **kw)
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, json.loads(p.stdout), elapsed


def of(data, host, check=None, status=None):
    return [f for f in data["findings"] if f["host"] == host and (check is None or f["check"] == check)
            and (status is None or f["status"] == status)]


def assert_green(data, host, e2e_ran=True):
    cells = data["summary"][host]
    assert cells["ssh"] == "ok" and cells["env"] == "ok" and cells["network"] == "ok", of(data, host)
    assert cells["firewall"] == "ok" and cells["gpu"] == "na", of(data, host)
    assert cells["e2e"] == ("ok" if e2e_ran else "na"), of(data, host, "e2e")


# ---- healthy ---------------------------------------------------------------------------------

def test_healthy_cluster_is_all_green_with_end_to_end_stage_times(cluster3):
    code, data, elapsed = doctor_json(cluster3)
    assert code == 0 and data["exit_code"] == 0
    prefixlen = cluster3.subnet.split("/")[1]
    for h in cluster3.hosts:
        assert_green(data, h.name)
        eth0 = next(i for i in data["interfaces"][h.name] if i["name"] == "eth0")
        assert eth0["up"] and eth0["addrs"] == [f"{h.addr}/{prefixlen}"] and eth0["mtu"]
    assert not [f for f in data["findings"] if f["status"] in ("warn", "fail")]
    assert data["recommendation"]["cidr"] == cluster3.subnet
    assert data["recommendation"]["flags"]["dtrun"] == f"--include-iface {cluster3.subnet}"
    assert list(data["e2e"]["stages"]) == ["started", "init", "collective", "smoke"]
    gpu = of(data, cluster3.hosts[0].name, "gpu")[0]
    assert gpu["status"] == "na" and "nvidia-smi not found" in gpu["detail"]  # this machine has no GPU


def test_all_pairs_checks_ssh_between_the_hosts(cluster3):
    code, data, _ = doctor_json(cluster3, "--all-pairs", "--no-e2e")
    assert code == 0
    for h in cluster3.hosts:
        pair = [f for f in of(data, h.name, "ssh") if "other host(s) works (--all-pairs)" in f["detail"]]
        assert len(pair) == 1 and "ssh from" in pair[0]["detail"] and " to 2 other" in pair[0]["detail"]


def test_text_table_and_findings(cluster3):
    p, _ = run_doctor(cluster3, "--no-e2e")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split()[:7] == ["host", "┃", "ssh", "┃", "env", "┃", "network"]
    for h in cluster3.hosts:
        row = next(l for l in lines if l.startswith(h.name))
        assert row.count("✓") == 4 and "✗" not in row and "!" not in row
    assert lines[-1].startswith("doctor: 3 hosts, all checks passed")


def test_preflight_applies_the_subnet_and_caches_it(cluster3, tmp_path):
    env = user_env(XDG_CACHE_HOME=str(tmp_path))
    hosts = ",".join(f"{h.name}:1" for h in cluster3.hosts)
    prog = "import os, socket; print('RANK', socket.gethostname(), os.environ.get('NCCL_SOCKET_IFNAME'))"
    p = dtrun("--ssh-config", cluster3.ssh_config, "-H", hosts, "python", "-c", prog, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    ranks = sorted(l.split("RANK ", 1)[1] for l in p.stdout.splitlines() if "RANK " in l)
    assert ranks == [f"{h.name} =eth0" for h in cluster3.hosts]
    [cache] = list((tmp_path / "dtrun" / "preflight").iterdir())
    assert json.loads(cache.read_text())["include"] == cluster3.subnet
    stamp = cache.stat().st_mtime_ns
    p = dtrun("--ssh-config", cluster3.ssh_config, "-H", hosts, "python", "-c", prog, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert cache.stat().st_mtime_ns == stamp  # served from the cache: no second preflight


def test_keyscan_of_a_known_host_changes_nothing(cluster3):
    before = cluster3.known_hosts.read_text()
    p = dtrun("keyscan", "--ssh-config", cluster3.ssh_config, cluster3.hosts[0].name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "already in" in p.stdout and cluster3.known_hosts.read_text() == before


# ---- ssh faults: dead, black-holed, changed key, unknown key -----------------------------------

@pytest.fixture(scope="module")
def ssh_faults():
    skip_if_unavailable()
    c = Cluster(5, faults={1: {"dead"}, 2: {"blackhole"}, 3: {"changed_hostkey"}, 4: {"unknown_hostkey"}}).up()
    try:
        yield c
    finally:
        c.down()


def test_each_ssh_fault_is_named_on_its_host_only(ssh_faults):
    c = ssh_faults
    h1, dead, hole, changed, unknown = (h.name for h in c.hosts)
    code, data, elapsed = doctor_json(c, "--timeout", "2")
    assert code == 1
    assert_green(data, h1, e2e_ran=False)
    [f] = of(data, dead, "ssh", "fail")
    assert f["detail"].startswith(f"TCP to {dead} ({c.hosts[1].addr}:22) refused") and "sshd" in f["detail"]
    assert f["fix"].startswith(f"start sshd on {dead}")
    [f] = of(data, hole, "ssh", "fail")
    assert f"TCP to {hole} ({c.hosts[2].addr}:22) timed out after 2 s" in f["detail"]
    [f] = of(data, changed, "ssh", "fail")
    assert f["detail"].startswith("HOST KEY CHANGED") and str(c.known_hosts) in f["detail"]
    [f] = of(data, unknown, "ssh", "fail")
    assert "is not in" in f["detail"] and f"dtrun keyscan --ssh-config {c.ssh_config} {unknown}" in f["fix"]
    for h in (dead, hole, changed, unknown):
        assert data["summary"][h]["env"] == "na"  # nothing else is claimed about hosts it cannot reach
    # The black-holed host costs its 2 s timeout, not more; the rest run beside it.
    assert elapsed < 2 + 4, data["timings"]


def test_keyscan_refuses_a_changed_key_and_adds_an_unknown_one_only_when_confirmed(ssh_faults):
    c = ssh_faults
    changed, unknown = c.hosts[3].name, c.hosts[4].name
    before = c.known_hosts.read_text()
    p = dtrun("keyscan", "--ssh-config", c.ssh_config, changed)
    assert p.returncode == 1 and "HOST KEY CHANGED" in p.stdout and "does not replace" in p.stdout
    assert c.known_hosts.read_text() == before
    p = subprocess.run([DTRUN, "keyscan", "--ssh-config", str(c.ssh_config), unknown], input="n\n",
                       capture_output=True, text=True, timeout=60, env=user_env())
    assert p.returncode == 1 and "SHA256:" in p.stdout and "not added" in p.stdout
    assert c.known_hosts.read_text() == before
    p = dtrun("keyscan", "--ssh-config", c.ssh_config, "--yes", unknown)
    assert p.returncode == 0 and f"{unknown}: added to {c.known_hosts}" in p.stdout
    added = c.known_hosts.read_text()[len(before):]
    assert added.startswith(f"{c.hosts[4].addr} ssh-ed25519 ")
    code, data, _ = doctor_json(c, "--include", f"{c.hosts[0].name},{unknown}", "--no-e2e")
    assert code == 0 and data["summary"][unknown]["ssh"] == "ok"


def test_preflight_refuses_to_launch_into_a_dead_host_or_a_changed_key(ssh_faults, tmp_path):
    c = ssh_faults
    env = user_env(XDG_CACHE_HOME=str(tmp_path))
    for bad in (c.hosts[1].name, c.hosts[3].name):
        t0 = time.monotonic()
        p = dtrun("--ssh-config", c.ssh_config, "-H", f"{c.hosts[0].name},{bad}", "python", "-c", "print(1)",
                  env=env, timeout=60)
        assert p.returncode == 1, p.stderr
        assert f"dtrun: preflight: {bad}: " in p.stderr and "--no-preflight" in p.stderr
        assert time.monotonic() - t0 < 10
    assert not (tmp_path / "dtrun" / "preflight").exists() or not list((tmp_path / "dtrun" / "preflight").iterdir())


# ---- environment and firewall faults ---------------------------------------------------------

@pytest.fixture(scope="module")
def env_faults():
    """h2 firewall, h3 PATH without the venv, h4 no LD_LIBRARY_PATH, h5 other MPI on PATH and no script.

    The hosts share the file system, so the script is hidden on h5 alone with `ip netns exec`'s
    /etc/netns/<netns>/ bind mounts: an empty directory there covers /etc/<dir> inside that host.
    """
    skip_if_unavailable()
    prefix = "dd" + secrets.token_hex(3)
    hidden = f"dtrun-doctor-{prefix}"
    shadow = Path("/etc/netns") / f"dtrun-{prefix}-h5" / hidden
    made_netns_dir = not Path("/etc/netns").exists()
    script = Path("/etc") / hidden / "train.py"
    script.parent.mkdir()
    script.write_text("print('train')\n")
    shadow.mkdir(parents=True)
    c = Cluster(5, prefix=prefix, faults={1: {"firewall"}, 2: {"bad_path"}, 3: {"no_ld_library_path"},
                                          4: {"other_mpi"}})
    try:
        c.up()
        c.script = script
        yield c
    finally:
        c.down()
        shutil.rmtree(script.parent, ignore_errors=True)
        shutil.rmtree(shadow.parent, ignore_errors=True)
        if made_netns_dir:
            with contextlib.suppress(OSError):
                os.rmdir("/etc/netns")  # only if empty: another run may be using it


def test_each_environment_fault_is_named_on_its_host_only(env_faults):
    c = env_faults
    h1, fw, badpath, nold, other = (h.name for h in c.hosts)
    code, data, _ = doctor_json(c, "--timeout", "2", "--program", str(c.script), "--no-e2e")
    assert code == 1
    assert_green(data, h1, e2e_ran=False)
    # firewall: every connection into h2 times out; h2's own connections out work
    [f] = of(data, fw, "firewall", "fail")
    assert f"→ {fw}:" in f["detail"] and f"{fw} drops incoming TCP other than SSH" in f["detail"]
    assert f"{h1}, " in f["detail"] and "timed out after 2 s" in f["detail"]
    assert [x["check"] for x in data["findings"] if x["status"] == "fail" and x["host"] != other] == ["firewall"]
    # remote PATH without the MPI
    path = [x for x in of(data, badpath, "env", "warn") if "prted is not on" in x["detail"]]
    assert len(path) == 1 and "non-interactive PATH (/usr/bin:/bin)" in path[0]["detail"]
    # LD_LIBRARY_PATH unset on one host
    [f] = of(data, nold, "env", "warn")
    assert f"LD_LIBRARY_PATH in a non-interactive shell on {nold} is unset" in f["detail"]
    assert "it is /usr/local/lib" in f["detail"]
    # the script missing on one host
    [f] = of(data, other, "env", "fail")
    assert f["detail"] == f"the program {c.script} does not exist on {other}"
    # another MPI first on PATH (Debian's Open MPI 4.1.4 from the test cluster)
    if os.path.exists("/usr/bin/orterun"):
        [f] = [x for x in of(data, other, "env", "warn") if "`mpirun`" in x["detail"]]
        assert "is Open MPI 4.1.4" in f["detail"] and "this host launches Open MPI 5" in f["detail"]
    for h in (fw, badpath, nold, other):
        assert data["summary"][h]["ssh"] == "ok" and data["summary"][h]["network"] == "ok"
    for h in (h1, badpath, nold, other):
        assert data["summary"][h]["firewall"] == "ok"


def test_end_to_end_hang_is_narrowed_to_the_firewalled_host(env_faults):
    """The staged job itself, on hosts where the static checks were skipped: it hangs, and says where."""
    names = [h.name for h in env_faults.hosts[:3]]  # h2 drops incoming TCP
    findings, summary = e2e.end_to_end(names, str(env_faults.ssh_config), env_faults.subnet,
                                       {n: n for n in names}, timeout=10, pair_timeout=8)
    assert summary["returncode"] is None and summary["hung_at"] in ("init", "collective")
    by = {f.host: f for f in findings}
    assert by[names[1]].status == "fail" and by[names[0]].status == "ok" and by[names[2]].status == "ok"
    assert "every pair of hosts that hangs includes it" in by[names[1]].detail
    assert "hung at 'MPI init" in by[names[1]].detail or "hung at 'first collective" in by[names[1]].detail
    assert {tuple(p["hosts"]): p["hung_at"] for p in summary["pairs"]}[(names[0], names[2])] is None


# ---- docker0 on every host -------------------------------------------------------------------

def test_docker0_everywhere_is_flagged_and_the_recommendation_makes_the_job_pass(make_cluster):
    c = make_cluster(3, cluster_faults={"docker0"})
    p, _ = run_doctor(c)
    assert p.returncode == 0, p.stdout + p.stderr
    # one block for the three hosts, naming them as a range, not one block per host
    blocks = [l for l in p.stdout.splitlines() if l.startswith("! ") and "[network]" in l]
    everyone = ", ".join(x.name for x in c.hosts)
    assert len(blocks) == 1 and blocks[0].startswith(f"! {c.prefix}-h[1-3] [network] "), p.stdout
    assert "docker0 (172.17.0.1/16) is a container or VM bridge" in blocks[0]
    assert f"same address on {everyone}" in blocks[0]
    for h in c.hosts:
        row = next(l for l in p.stdout.splitlines() if l.startswith(h.name))
        assert row.split()[-1] == "✓"  # the end-to-end column
    assert f"network: use {c.subnet}" in p.stdout
    assert "end to end: started" in p.stdout and "smoke" in p.stdout
