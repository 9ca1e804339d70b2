"""Pure logic of the network and firewall checks: parsing, the subnet choice, blame for blocked pairs."""
import json

from dtrun.checks import firewall, network
from dtrun.checks.network import Interface, Recommendation
from dtrun.checks.result import FAIL, OK, WARN
from dtrun.launcher.flavors import MPICH, OPENMPI, Flavor


def ip_json(*ifaces):
    """Text like `ip -j addr` prints, for (name, flags, operstate, mtu, [addr/len, ...])."""
    out = []
    for name, flags, state, mtu, addrs in ifaces:
        out.append({"ifname": name, "flags": flags, "mtu": mtu, "operstate": state,
                    "addr_info": [{"family": "inet", "local": a.split("/")[0], "prefixlen": int(a.split("/")[1])}
                                  for a in addrs] + [{"family": "inet6", "local": "fe80::1", "prefixlen": 64}]})
    return json.dumps(out)


UP = ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"]


def docker_host(addr, mtu=1500):
    return network.parse_ip_json(ip_json(
        ("lo", ["LOOPBACK", "UP", "LOWER_UP"], "UNKNOWN", 65536, ["127.0.0.1/8"]),
        ("eth0", UP, "UP", mtu, [addr]),
        ("docker0", ["NO-CARRIER", "BROADCAST", "MULTICAST", "UP"], "DOWN", 1500, ["172.17.0.1/16"]),
    ))


def test_parse_ip_json_keeps_ipv4_state_and_mtu():
    ifs = docker_host("10.0.0.11/24", mtu=9000)
    assert [(i.name, i.up, i.mtu, i.addrs) for i in ifs] == [
        ("lo", True, 65536, ("127.0.0.1/8",)),
        ("eth0", True, 9000, ("10.0.0.11/24",)),
        ("docker0", False, 1500, ("172.17.0.1/16",)),  # NO-CARRIER: operstate DOWN
    ]
    assert ifs[2].virtual and not ifs[1].virtual and ifs[0].loopback


def test_parse_sysfs_fallback():
    items = [{"ifname": "eth0", "operstate": "up", "mtu": "1500", "flags": "0x1003", "inet": ["10.1.2.3", "255.255.255.0"]},
             {"ifname": "eth1", "operstate": "down", "mtu": "9000", "flags": "0x1002", "inet": None}]
    assert network.parse_sysfs(items) == [Interface("eth0", True, 1500, ("10.1.2.3/24",)),
                                          Interface("eth1", False, 9000, ())]


def test_virtual_names():
    for name in ("docker0", "virbr0", "veth12ab", "br-0f3e", "cni0"):
        assert Interface(name, True, 1500).virtual, name
    for name in ("eth0", "ens5", "ib0", "bond0", "enp1s0f0"):
        assert not Interface(name, True, 1500).virtual, name


def test_recommend_skips_docker0_everywhere_and_prefers_the_ssh_subnet():
    hosts = {"h1": docker_host("10.0.0.11/24"), "h2": docker_host("10.0.0.12/24"), "h3": docker_host("10.0.0.13/24")}
    launcher = network.parse_ip_json(ip_json(("br0", UP, "UP", 1500, ["10.0.0.1/24"]),
                                             ("wlan0", UP, "UP", 1500, ["192.168.1.5/24"])))
    rec = network.recommend(hosts, launcher, {"h1": "10.0.0.11", "h2": "10.0.0.12", "h3": "10.0.0.13"})
    assert rec.cidr == "10.0.0.0/24" and rec.launcher_on_it
    assert rec.ifaces == (("h1", "eth0"), ("h2", "eth0"), ("h3", "eth0"))
    assert rec.nccl_socket_ifname == "=eth0"


def test_recommend_rejects_a_subnet_with_the_same_address_on_two_hosts():
    # A "real" looking interface that carries one address on every host (cloned VM images do this).
    same = lambda a: network.parse_ip_json(ip_json(("eth0", UP, "UP", 1500, [a]), ("eth1", UP, "UP", 1500, ["192.168.9.1/24"])))
    rec = network.recommend({"h1": same("10.0.0.11/24"), "h2": same("10.0.0.12/24")})
    assert rec.cidr == "10.0.0.0/24"
    assert network.recommend({"h1": same("10.0.0.11/24"), "h2": same("10.0.0.11/24")}) is None


def test_recommend_without_the_launcher_on_the_subnet():
    hosts = {"h1": docker_host("10.0.0.11/24"), "h2": docker_host("10.0.0.12/24")}
    laptop = network.parse_ip_json(ip_json(("wlan0", UP, "UP", 1500, ["192.168.1.5/24"])))
    rec = network.recommend(hosts, laptop)
    assert rec.cidr == "10.0.0.0/24" and not rec.launcher_on_it
    found = network.network_findings(hosts, rec, laptop)
    assert [f.status for f in found if f.host == network.LAUNCHER] == [WARN]


def test_recommend_prefers_larger_mtu_among_shared_subnets():
    two = lambda a, b: network.parse_ip_json(ip_json(("eth0", UP, "UP", 1500, [a]), ("ib0", UP, "UP", 4092, [b])))
    rec = network.recommend({"h1": two("10.0.0.1/24", "10.9.0.1/24"), "h2": two("10.0.0.2/24", "10.9.0.2/24")})
    assert rec.cidr == "10.9.0.0/24" and rec.iface_names == ["ib0"]
    # ...unless SSH reaches the hosts over the other one.
    rec = network.recommend({"h1": two("10.0.0.1/24", "10.9.0.1/24"), "h2": two("10.0.0.2/24", "10.9.0.2/24")},
                            reached={"h1": "10.0.0.1", "h2": "10.0.0.2"})
    assert rec.cidr == "10.0.0.0/24"


def test_flags_per_flavor_match_what_dtrun_emits():
    rec = Recommendation("10.0.0.0/24", (("h1", "eth0"), ("h2", "eth0")), "test")
    f5 = rec.flags(Flavor(OPENMPI, (5, 0, 11)))
    assert f5["mpirun"] == ("--mca btl_tcp_if_include 10.0.0.0/24 --prtemca prte_if_include 10.0.0.0/24 "
                            "--pmixmca ptl_base_if_include 10.0.0.0/24")
    assert rec.flags(Flavor(OPENMPI, (4, 1, 4)))["mpirun"] == \
        "--mca btl_tcp_if_include 10.0.0.0/24 --mca oob_tcp_if_include 10.0.0.0/24"
    assert rec.flags(Flavor(MPICH, (4, 2)))["mpirun"] == "-iface eth0"
    assert f5["dtrun"] == "--include-iface 10.0.0.0/24" and f5["nccl"] == "NCCL_SOCKET_IFNAME==eth0"
    mixed = Recommendation("10.0.0.0/24", (("h1", "eth0"), ("h2", "ens5")), "test")
    assert mixed.nccl_socket_ifname == "ens5,eth0"


def test_network_findings_flag_docker0_on_every_host_and_nothing_else():
    hosts = {"h1": docker_host("10.0.0.11/24"), "h2": docker_host("10.0.0.12/24")}
    rec = network.recommend(hosts)
    found = network.network_findings(hosts, rec)
    warns = [f for f in found if f.status == WARN]
    assert [f.host for f in warns] == ["h1", "h2"]
    assert "docker0 (172.17.0.1/16)" in warns[0].detail and "same address on h1, h2" in warns[0].detail
    assert "--include-iface 10.0.0.0/24" in warns[0].fix
    assert [f.detail for f in found if f.status == OK] == ["eth0 on 10.0.0.0/24 (MTU 1500)"] * 2


def test_network_findings_mtu_mismatch_names_both_values():
    hosts = {"h1": docker_host("10.0.0.11/24", 9000), "h2": docker_host("10.0.0.12/24", 9000),
             "h3": docker_host("10.0.0.13/24", 1500)}
    found = network.network_findings(hosts, network.recommend(hosts))
    mtu = [f for f in found if "MTU 1500 while" in f.detail]
    assert len(mtu) == 1 and mtu[0].host == "h3" and "h1, h2 use 9000" in mtu[0].detail


def test_network_findings_without_a_shared_subnet_fail_on_every_host():
    a = network.parse_ip_json(ip_json(("eth0", UP, "UP", 1500, ["10.0.0.1/24"])))
    b = network.parse_ip_json(ip_json(("eth0", UP, "UP", 1500, ["10.1.0.1/24"])))
    found = network.network_findings({"h1": a, "h2": b}, network.recommend({"h1": a, "h2": b}))
    assert [f.status for f in found] == [FAIL, FAIL]
    assert "h2 has 10.1.0.1/24" in found[1].detail


ENDPOINTS = {"h1": ("10.0.0.1", 40001), "h2": ("10.0.0.2", 40002), "h3": ("10.0.0.3", 40003)}


def test_connect_plan_is_every_ordered_pair():
    plan = firewall.connect_plan(ENDPOINTS)
    assert plan["h1"] == [["h2", "10.0.0.2", 40002], ["h3", "10.0.0.3", 40003]]
    assert sum(len(v) for v in plan.values()) == 6


def results_with(blocked):
    """Connect results where the (src, dst) pairs in ``blocked`` time out."""
    return {s: {d: (["timeout", 2.0, "timed out after 2 s"] if (s, d) in blocked else ["ok", 0.001, ""])
                for d in ENDPOINTS if d != s} for s in ENDPOINTS}


def test_firewall_blames_the_host_nobody_reaches():
    found = firewall.firewall_findings(results_with({("h1", "h3"), ("h2", "h3")}), ENDPOINTS, "10.0.0.0/24")
    bad = [f for f in found if f.status == FAIL]
    assert len(bad) == 1 and bad[0].host == "h3"
    assert bad[0].detail == ("h1, h2 → h3:40003 timed out after 2 s: h3 drops incoming TCP other than SSH "
                             "(a firewall)")
    assert "iptables -I INPUT -s 10.0.0.0/24" in bad[0].fix
    assert {f.host for f in found if f.status == OK} == {"h1", "h2"}


def test_firewall_blames_a_host_whose_outgoing_traffic_is_blocked():
    found = firewall.firewall_findings(results_with({("h2", "h1"), ("h2", "h3")}), ENDPOINTS, "10.0.0.0/24")
    bad = [f for f in found if f.status == FAIL]
    assert [f.host for f in bad] == ["h2"] and "outgoing traffic blocked" in bad[0].detail


def test_firewall_names_a_single_blocked_pair():
    found = firewall.firewall_findings(results_with({("h1", "h2")}), ENDPOINTS, "10.0.0.0/24")
    bad = [f for f in found if f.status == FAIL]
    assert [f.host for f in bad] == ["h2"]
    assert bad[0].detail.startswith("h1 → h2:40002 timed out") and "these pairs are blocked" in bad[0].detail
