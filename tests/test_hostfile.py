"""Parsing of every host format, on values (no processes)."""
import os
from pathlib import Path

import pytest

from dtrun.launcher.errors import HostfileError, UnknownHostError, UsageError
from dtrun.launcher.hostfile import (
    HostSlots, parse_cluster_yaml, parse_host_list, parse_hostfile, read_cluster_file,
    read_hostfile, slurm_hosts,
)
from dtrun.launcher.hosts import HostOptions, HostSelection, merge_duplicates, resolve_hosts, resolve_np

HOSTFILES = Path(__file__).resolve().parent.parent / "hostfiles"


def names_slots(hosts):
    return [(h.host, h.slots) for h in hosts]


def test_host_list_with_slots_and_bare_hosts():
    assert names_slots(parse_host_list("server1:4,server2:4,server3")) == [("server1", 4), ("server2", 4), ("server3", 1)]


def test_host_list_ipv6_in_brackets():
    assert names_slots(parse_host_list("[fe80::1]:2,10.0.0.1:3")) == [("fe80::1", 2), ("10.0.0.1", 3)]


@pytest.mark.parametrize("text, message", [
    ("server1:0", "slots for server1 must be a positive integer, got 0"),
    ("server1:-2", "slots for server1 must be a positive integer, got -2"),
    ("server1:four", "slots for server1 must be a positive integer, got 'four'"),
    ("server1:2.5", "got '2.5'"),
    ("a,,b", "empty entry"),
    ("-oProxyCommand=x:1", "invalid host name '-oProxyCommand=x'"),
    ("bad host:1", "invalid host name 'bad host'"),
    ("h;rm -rf:1", "invalid host name"),
    ("", "empty host list"),
])
def test_host_list_errors_name_the_problem(text, message):
    with pytest.raises(HostfileError) as e:
        parse_host_list(text)
    assert str(e.value).startswith("-H: ")
    assert message in str(e.value)


def test_openmpi_hostfile_with_comments_and_max_slots():
    text = "# cluster\n\nnode1 slots=4 max_slots=8\nnode2 slots=2  # trailing comment\nnode3\n"
    hosts = parse_hostfile(text, "hf")
    assert names_slots(hosts) == [("node1", 4), ("node2", 2), ("node3", 1)]
    assert hosts[0].max_slots == 8 and hosts[0].source == "hf:3"


def test_mpich_hostfile_form():
    assert names_slots(parse_hostfile("node1:4\nnode2:2\n", "hf")) == [("node1", 4), ("node2", 2)]


def _parse_hostfile(text):
    return parse_hostfile(text, "hosts.txt")


def _parse_cluster(text):
    return parse_cluster_yaml(text, "c.yaml")


@pytest.mark.parametrize("parse, text, line, message", [
    (_parse_hostfile, "node1 slots=4\nnode2 slots=0\n", 2, "slots must be a positive integer, got 0"),
    (_parse_hostfile, "node1 slots=x\n", 1, "slots must be a positive integer, got 'x'"),
    (_parse_hostfile, "node1 sockets=2\n", 1, "unknown key 'sockets'"),
    (_parse_hostfile, "node1 4\n", 1, "expected key=value after the host name, got '4'"),
    (_parse_hostfile, "\n\nno_de$ slots=1\n", 3, "invalid host name 'no_de$'"),
    (_parse_hostfile, "node1 slots=4 max_slots=2\n", 1, "max_slots=2 is less than slots=4"),
    (_parse_hostfile, "node1:2 slots=3\n", 1, "slots given twice"),
    (_parse_cluster, "hosts:\n  - a\n  - {name: b, slots: 0}\n", 3, "slots must be a positive integer, got 0"),
    (_parse_cluster, "hosts:\n  - {slots: 2}\n", 2, "host entry has no 'name:'"),
    (_parse_cluster, "hosts:\n  - {name: b, port: 70000}\n", 2, "port must be 1-65535"),
    (_parse_cluster, "hosts:\n  - {name: b, colour: red}\n", 2, "unknown key 'colour'"),
    (_parse_cluster, "hosts: [a, b\n", None, "invalid YAML"),
    (_parse_cluster, "nodes: [a]\n", 1, "unknown key 'nodes'"),
    (_parse_cluster, "hosts: []\n", 1, "'hosts:' must be a non-empty list"),
    (_parse_cluster, "hosts:\n  - 'a b'\n", 2, "invalid host name 'a b'"),
])
def test_host_file_errors_name_file_and_line(parse, text, line, message):
    """Hostfiles and cluster files: the error starts with FILE:LINE (or FILE where no line applies)."""
    source = "hosts.txt" if parse is _parse_hostfile else "c.yaml"
    with pytest.raises(HostfileError) as e:
        parse(text)
    assert str(e.value).startswith(f"{source}:{line}: " if line else source)
    assert message in str(e.value)


def test_empty_hostfile_is_an_error():
    with pytest.raises(HostfileError, match="hosts.txt: no hosts in file"):
        parse_hostfile("# nothing\n\n", "hosts.txt")


def test_missing_hostfile():
    with pytest.raises(HostfileError, match="/nonexistent/hf: no such file"):
        read_hostfile("/nonexistent/hf")


def test_cluster_yaml_defaults_and_overrides():
    cf = parse_cluster_yaml(
        "defaults: {slots: 4, user: mpi, identity_file: /k/id}\nssh_config: /etc/cfg\nhosts:\n"
        "  - a\n  - {name: b, slots: 2, port: 2222, user: ops}\n", "c.yaml")
    a, b = cf.hosts
    assert (a.host, a.slots, a.user, a.port, a.identity_file) == ("a", 4, "mpi", None, "/k/id")
    assert (b.host, b.slots, b.user, b.port, b.identity_file) == ("b", 2, "ops", 2222, "/k/id")
    assert cf.ssh_config == "/etc/cfg"
    assert b.source == "c.yaml:5"




def test_slurm_compressed_nodelist_and_tasks():
    hosts = slurm_hosts({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[01-04,07]", "SLURM_TASKS_PER_NODE": "4(x2),2(x2),1"})
    assert names_slots(hosts) == [("node01", 4), ("node02", 4), ("node03", 2), ("node04", 2), ("node07", 1)]


def test_slurm_mismatch_is_an_error():
    with pytest.raises(HostfileError, match="SLURM_TASKS_PER_NODE: '4' gives 1 counts for 2 nodes"):
        slurm_hosts({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "4"})


def test_outside_slurm_is_none():
    assert slurm_hosts({}) is None


def test_leftover_nodelist_without_job_id_is_not_an_allocation():
    # A shell that once ran inside salloc keeps SLURM_JOB_NODELIST after the job ended.
    leftover = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert slurm_hosts(leftover) is None
    assert resolve_hosts(environ=leftover).names == ["localhost"]


def test_resolve_prefers_explicit_then_slurm_then_localhost():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert resolve_hosts(environ=env).names == ["n1", "n2"]
    assert resolve_hosts(HostOptions(host_list="a:1"), environ=env).names == ["a"]
    local = resolve_hosts(environ={})
    assert local.names == ["localhost"] and local.total_slots == os.cpu_count()


def test_two_host_sources_is_an_error():
    with pytest.raises(UsageError, match="give only one of -H, --hostfile and --cluster"):
        resolve_hosts(HostOptions(host_list="a", hostfile="b"), environ={})


def test_duplicates_merge_with_warning():
    hosts, warnings = merge_duplicates(parse_host_list("a:2,b:1,a:3"))
    assert names_slots(hosts) == [("a", 5), ("b", 1)]
    assert warnings == ["host a is listed more than once; merged into 5 slots"]


def test_include_exclude():
    sel = resolve_hosts(HostOptions(host_list="a:1,b:2,c:3", include=("a,c",), exclude=("c",)), environ={})
    assert sel.names == ["a"]
    with pytest.raises(UnknownHostError, match="--include: zz not in the host list"):
        resolve_hosts(HostOptions(host_list="a,b", include=("zz",)), environ={})


def test_np_defaults_to_slots_and_checks_bounds():
    sel = HostSelection((HostSlots("a", 2), HostSlots("b", 2)), "-H")
    assert resolve_np(None, sel, False) == 4
    assert resolve_np(3, sel, False) == 3
    assert resolve_np(6, sel, True) == 6
    with pytest.raises(UsageError, match="-np 6 is more than the 4 slots of -H: add slots to the hosts or pass --oversubscribe"):
        resolve_np(6, sel, False)
    with pytest.raises(UsageError, match="-np must be a positive integer, got 0"):
        resolve_np(0, sel, False)


def test_shipped_hostfiles_parse():
    assert names_slots(read_hostfile(HOSTFILES / "localhost")) == [("localhost", 2)]
    four = [(f"server{i}", 4) for i in range(1, 5)]
    assert names_slots(read_hostfile(HOSTFILES / "cluster-4x4")) == four
    assert names_slots(read_hostfile(HOSTFILES / "cluster-4x4.mpich")) == four
    cf = read_cluster_file(HOSTFILES / "cluster.yaml")
    assert names_slots(cf.hosts) == [("server1", 4), ("server2", 4), ("server3", 2), ("server4", 4)]
    assert cf.hosts[3].port == 2222 and cf.hosts[3].user == "ops" and cf.hosts[0].user == "mpiuser"
