"""Hardening, round 2: usage errors before the network, a preflight cache trusted only when it
checks out, Open MPI 5's osc/ucx kept quiet (and one-sided MPI still right across hosts), and
doctor's findings grouped across hosts."""
import json
import os
import re
import time

import pytest

from dtrun.checks import doctorreport, preflight
from dtrun.checks.result import FAIL, OK, WARN, Finding
from dtrun.launcher.command import build_command, build_groups
from dtrun.launcher.flavors import MPICH, OPENMPI, Flavor
from dtrun.launcher.hostfile import HostSlots, parse_host_list
from dtrun.launcher.interfaces import Interface
from tests.dtrun_helpers import dtrun, one_line_error, user_env
from tests.test_command import HYDRA, OMPI4, OMPI5, line, spec

NOHOST = "nohost.invalid"  # RFC 2606: never resolves


# ---- usage errors come before any network step ------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--dry-run", "-np", "0", "-H", f"{NOHOST}:2", "python", "x.py"], "-np must be a positive integer, got 0"),
    (["--dry-run", "-np", "5", "-H", f"{NOHOST}:2", "python", "x.py"], "-np 5 is more than the 2 slots of -H"),
    (["-np", "5", "-H", f"{NOHOST}:2", "python", "x.py"], "-np 5 is more than the 2 slots of -H"),
    (["--dry-run", "-H", f"{NOHOST}:2"], "no program given"),
    (["-H", f"{NOHOST}:2", "-x", "A B", "python", "x.py"], "-x 'A B'"),
    (["-H", f"{NOHOST}:2", "--include-iface", "eth0", "--exclude-iface", "eth1", "python", "x.py"],
     "--include-iface and --exclude-iface cannot be used together"),
    (["-H", f"{NOHOST}:2", "--include-iface", "eth0;reboot", "python", "x.py"], "--include-iface: invalid interface"),
    (["-H", f"{NOHOST}:2", "--mca", "btl", "tcp;reboot", "python", "x.py"], "--mca btl: value"),
    (["-H", f"{NOHOST}:2", "--mpi-args", '"--foo', "python", "x.py"], "--mpi-args"),
    (["-H", f"{NOHOST}:2", "--log-dir", "a\nb", "python", "x.py"], "--log-dir"),
    (["-H", f"{NOHOST}:2", "--mpirun", "/usr/bin/mpiexec.mpich", "--mca", "btl", "tcp", "python", "x.py"],
     "--mca is an Open MPI option"),
])
def test_usage_errors_are_reported_before_the_preflight_touches_a_host(tmp_path, args, needle):
    p = dtrun(*args, env=user_env(XDG_CACHE_HOME=str(tmp_path)), timeout=60)
    text = one_line_error(p, needle)
    assert "preflight" not in text and NOHOST not in text  # no host was looked up or connected to
    assert "Traceback" not in p.stderr


# ---- the preflight cache is used only when it passes the checks a fresh result does ----------

HOSTS = ("h1", "h2")
HERE = [Interface("eth0", True, 1500, ("10.9.0.9/24",))]
GOOD = {"include": "10.9.0.0/24", "nccl": "=eth0",
        "host_ifaces": [["h1", [["lo", "127.0.0.1/8"], ["eth0", "10.9.0.1/24"]]], ["h2", [["eth0", "10.9.0.2/24"]]]]}


def _write(tmp_path, monkeypatch, entry, mode=0o600):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = preflight.cache_key(tuple(HostSlots(h) for h in HOSTS), None)
    path = tmp_path / "dtrun" / "preflight" / f"{key}.json"
    path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    path.write_text(json.dumps({"time": time.time(), **entry}))  # the entry's own "time" wins
    os.chmod(path, mode)
    return key, path


def _read(key, needs_context=False):
    """The launch's read (with its hosts, this host's interfaces and a note); unless the entry is
    bad only for this launch, a plain read of the key must refuse it as well."""
    if not needs_context:
        assert preflight.read_cache(key) is None
    notes = []
    hit = preflight.read_cache(key, remote_hosts=HOSTS, local_ifaces=HERE, note=notes.append)
    return hit, notes


def test_a_cache_entry_that_checks_out_is_used(tmp_path, monkeypatch):
    key, _ = _write(tmp_path, monkeypatch, GOOD)
    notes = []
    hit = preflight.read_cache(key, remote_hosts=HOSTS, local_ifaces=HERE, note=notes.append)
    assert (hit.include, hit.nccl) == ("10.9.0.0/24", "=eth0") and notes == []
    assert dict(hit.host_ifaces)["h2"] == (("eth0", "10.9.0.2/24"),)


def _poisoned(**change):
    entry = json.loads(json.dumps(GOOD))
    for k, v in change.items():
        if k == "iface":
            entry["host_ifaces"][1][1][0][0] = v
        elif k == "addr":
            entry["host_ifaces"][1][1][0][1] = v
        else:
            entry[k] = v
    return entry


@pytest.mark.parametrize("entry, reason", [
    (_poisoned(include="192.0.2.0/24"), "subnet 192.0.2.0/24 is not on h1"),
    (_poisoned(include="10.9.0.0/33"), "invalid subnet"),
    (_poisoned(include="10.9.0.7/24"), "not a subnet in CIDR form"),  # not the network's own address
    (_poisoned(include="10.9.0.0/24 --mca plm_rsh_agent sh"), "invalid subnet"),
    (_poisoned(include="10.9.0.0/24\n"), "invalid subnet"),
    (_poisoned(include=["10.9.0.0/24"]), "not a subnet in CIDR form"),
    (_poisoned(include=None), "NCCL_SOCKET_IFNAME without a subnet"),
    (_poisoned(nccl="=eth0\nLD_PRELOAD=/tmp/x.so"), "not a plain interface name"),
    (_poisoned(nccl="=eth0;reboot"), "not a plain interface name"),
    (_poisoned(nccl="=ib0"), "does not name the interfaces on 10.9.0.0/24"),
    (_poisoned(nccl=7), "is not text"),
    (_poisoned(iface="eth 0"), "not a plain interface name"),
    (_poisoned(iface="eth0\n"), "not a plain interface name"),
    (_poisoned(iface="$(reboot)"), "not a plain interface name"),
    (_poisoned(iface=["eth0"]), "not a plain interface name"),
    (_poisoned(addr="10.9.0.2/24; reboot"), "10.9.0.2/24; reboot"),
    (_poisoned(addr="10.8.0.2/24"), "subnet 10.9.0.0/24 is not on h2"),
    (_poisoned(host_ifaces=[["evil", [["eth0", "10.9.0.2/24"]]]]), "not this launch's (context)"),
    (_poisoned(host_ifaces={"h1": []}), "host_ifaces is not a list"),
    (_poisoned(time="now"), "time 'now' is not a number"),
    (_poisoned(time=time.time() + 3600), "written in the future"),
    ({**GOOD, "extra": 1}, "not a preflight result dtrun wrote"),
])
def test_a_poisoned_cache_entry_is_ignored_with_a_note(tmp_path, monkeypatch, entry, reason):
    key, path = _write(tmp_path, monkeypatch, entry)
    context = reason.endswith(" (context)")
    reason = reason.removesuffix(" (context)")
    hit, notes = _read(key, needs_context=context)
    assert hit is None
    [note] = notes
    assert note.startswith(f"preflight: cached result {path} ignored (") and "\n" not in note
    assert reason in note and note.endswith("; checking the hosts again")


def test_a_subnet_this_host_is_not_on_is_not_taken_from_the_cache(tmp_path, monkeypatch):
    key, _ = _write(tmp_path, monkeypatch, GOOD)
    notes = []
    assert preflight.read_cache(key, remote_hosts=HOSTS, local_ifaces=[Interface("eth0", True, 1500, ("10.8.0.9/24",))],
                                note=notes.append) is None
    assert "subnet 10.9.0.0/24 is not on this host" in notes[0]


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "other owner", "symlink", "open directory"])
def test_a_cache_file_someone_else_could_have_written_is_ignored(tmp_path, monkeypatch, how):
    key, path = _write(tmp_path, monkeypatch, GOOD, mode=0o666 if how == "world-writable" else
                       0o620 if how == "group-writable" else 0o600)
    if how == "other owner":
        os.chown(path, 65534, 65534)
    elif how == "symlink":
        real = tmp_path / "elsewhere.json"
        path.rename(real)
        path.symlink_to(real)
    elif how == "open directory":
        os.chmod(path.parent, 0o777)
    hit, notes = _read(key)
    assert hit is None and len(notes) == 1 and "ignored" in notes[0]


def test_the_cache_is_written_private_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    old = os.umask(0)
    try:
        key = preflight.cache_key(tuple(HostSlots(h) for h in HOSTS), None)
        result = preflight.PreflightResult((), GOOD["include"], GOOD["nccl"],
                                           tuple((h, tuple(map(tuple, items))) for h, items in GOOD["host_ifaces"]))
        preflight.write_cache(key, result)
    finally:
        os.umask(old)
    path = tmp_path / "dtrun" / "preflight" / f"{key}.json"
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    notes = []
    hit = preflight.read_cache(key, remote_hosts=HOSTS, local_ifaces=HERE, note=notes.append)
    assert hit == result and notes == []


@pytest.mark.cluster
def test_dry_run_never_shows_a_poisoned_cached_subnet(cluster3, tmp_path):
    """The reproduction: an `include` of 192.0.2.0/24 planted in the cache was shown as found by the preflight."""
    from dtrun.checks.sshtarget import ssh_config_path

    env = user_env(XDG_CACHE_HOME=str(tmp_path))
    hosts = ",".join(f"{h.name}:1" for h in cluster3.hosts)
    key = preflight.cache_key(tuple(parse_host_list(hosts)), ssh_config_path(str(cluster3.ssh_config), None, env))
    path = tmp_path / "dtrun" / "preflight" / f"{key}.json"
    path.parent.mkdir(parents=True, mode=0o700)
    ifaces = [[h.name, [["eth0", f"{h.addr}/{cluster3.subnet.split('/')[1]}"]]] for h in cluster3.hosts]
    for poison in ({"include": "192.0.2.0/24", "nccl": "=eth0", "host_ifaces": ifaces},
                   {"include": "192.0.2.0/24", "nccl": "=eth0", "host_ifaces": []},
                   {"include": cluster3.subnet, "nccl": "=eth0 -x LD_PRELOAD=/tmp/x.so", "host_ifaces": ifaces}):
        path.write_text(json.dumps({"time": time.time(), **poison}))
        os.chmod(path, 0o600)
        p = dtrun("--dry-run", "--ssh-config", cluster3.ssh_config, "-H", hosts, "python", "x.py", env=env, timeout=60)
        assert p.returncode == 0, p.stderr
        assert "192.0.2.0" not in p.stdout and "LD_PRELOAD" not in p.stdout
        assert f"--mca btl_tcp_if_include {cluster3.subnet}" in p.stdout, p.stdout
        assert f"subnet {cluster3.subnet} shared by all hosts, found by the preflight" in p.stdout
        notes = [ln for ln in p.stderr.splitlines() if "cached result" in ln]
        assert len(notes) == 1 and notes[0].startswith(f"dtrun: preflight: cached result {path} ignored (")


# ---- Open MPI 5: --mca osc ^ucx, with its reason, never over the user's own choice -----------

def test_open_mpi_5_leaves_osc_ucx_out_with_its_reason_and_only_there():
    groups = {g.args: g.why for g in build_groups(spec(), OMPI5)}
    assert "OSC UCX component priority set inside component query failed" in groups[("--mca", "osc", "^ucx")]
    for flavor in (OMPI4, HYDRA):  # 4.1 does not print it; MPICH has no MCA
        assert "osc" not in build_command(spec(), flavor)
    for own in (dict(mca=(("osc", "sm"),)), dict(env=("OMPI_MCA_osc=pt2pt",)), dict(env=("OMPI_MCA_osc",)),
                dict(env_names_set=frozenset({"OMPI_MCA_osc"})), dict(mpi_args=("--mca", "osc", "rdma")),
                dict(mca=(("pml", "ucx"),)), dict(env_names_set=frozenset({"OMPI_MCA_pml"}))):
        text = line(build_command(spec(**own), OMPI5))
        assert "^ucx" not in text, own
    assert "--mca osc '^ucx'" in line(build_command(spec(mca=(("pml", "ob1"),)), OMPI5))


def test_dry_run_shows_the_osc_flag_and_a_users_own_osc_wins():
    p = dtrun("--dry-run", "-np", "2", "-H", "localhost:2", "python", "x.py")
    row = next(ln for ln in p.stdout.splitlines() if "--mca osc" in ln)
    assert "'^ucx'" in row and "# MPI windows through osc/rdma and osc/sm" in row
    p = dtrun("--dry-run", "-np", "2", "-H", "localhost:2", "python", "x.py", env=user_env(OMPI_MCA_osc="rdma"))
    assert p.returncode == 0 and "--mca osc" not in p.stdout


RMA = r"""
from mpi4py import MPI
import numpy as np
comm = MPI.COMM_WORLD
r, n = comm.rank, comm.size
buf = np.zeros(2, dtype='i8')
win = MPI.Win.Create(buf, disp_unit=buf.itemsize, comm=comm)
win.Fence()
win.Put(np.array([100 + r], 'i8'), (r + 1) % n, target=0)
win.Fence()
win.Accumulate(np.array([10 * (r + 1)], 'i8'), 0, target=1, op=MPI.SUM)
win.Fence()
got = np.zeros(1, 'i8')
win.Get(got, (r + 1) % n, target=0)
win.Fence()
win.Free()
print('RMA', r, buf.tolist(), got.tolist(), flush=True)
"""


@pytest.mark.cluster
def test_one_sided_mpi_across_hosts_is_right_and_quiet(make_cluster, tmp_path):
    c = make_cluster(2)
    prog = tmp_path / "rma.py"
    prog.write_text(RMA)
    hosts = ",".join(f"{h.name}:1" for h in c.hosts)
    env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    p = dtrun("--ssh-config", c.ssh_config, "-H", hosts, "python", prog, env=env, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    rows = sorted(re.findall(r"RMA (\d) (\[[-\d, ]+\]) (\[[-\d]+\])", p.stdout))
    # rank r puts 100+r into its neighbour's slot 0, both add 10*(r+1) into rank 0's slot 1, and each
    # reads its neighbour's slot 0 back (what the other rank put there).
    assert rows == [("0", "[101, 30]", "[100]"), ("1", "[100, 0]", "[101]")], out
    assert "OSC UCX" not in out and "component query failed" not in out
    # the runtime's own window (collectives.init) across hosts: quiet too
    p = dtrun("--ssh-config", c.ssh_config, "-H", hosts, "python", "-c",
              "from dtrun import collectives; collectives.init(); print('INIT OK', flush=True)", env=env, timeout=120)
    assert p.returncode == 0 and p.stdout.count("INIT OK") == 2, p.stdout + p.stderr
    assert "OSC UCX" not in p.stdout + p.stderr


# ---- doctor: one block per finding, naming every host it holds for --------------------------

def _four_hosts():
    hosts = [f"hnode{i}" for i in range(1, 5)]
    same = "docker0 (172.17.0.1/16) carries the same address on hnode1, hnode2, hnode3, hnode4: MPI can hang"
    found = []
    for h in hosts:
        found += [Finding(h, "env", WARN, f"prted is not on {h}'s non-interactive PATH (/usr/bin:/bin)",
                          f"put /venv/bin on PATH for non-interactive shells on {h}"),
                  Finding(h, "network", WARN, same, "dtrun applies --include-iface 10.0.0.0/24 itself"),
                  Finding(h, "ssh", OK, f"root@{h} with id_ed25519")]
    found.append(Finding("hnode3", "env", FAIL, "the program /x.py does not exist on hnode3",
                         "copy it to hnode3 at the same path (rsync -a /x.py hnode3:/x.py)"))
    return hosts, found


def test_identical_findings_on_four_hosts_are_one_group_and_a_differing_one_stays_apart():
    hosts, found = _four_hosts()
    groups = doctorreport.group_findings([f for f in found if f.status != OK], {h: i for i, h in enumerate(hosts)})
    assert [(g.hosts, g.check, g.status) for g in groups] == [
        (tuple(hosts), "env", WARN), (tuple(hosts), "network", WARN), (("hnode3",), "env", FAIL)]
    assert groups[0].detail == "prted is not on each host's non-interactive PATH (/usr/bin:/bin)"
    assert groups[0].fix == "put /venv/bin on PATH for non-interactive shells on each host"
    assert groups[2].fix == "copy it to hnode3 at the same path (rsync -a /x.py hnode3:/x.py)"
    assert doctorreport.host_names(hosts) == "hnode[1-4]"
    assert doctorreport.host_names(["alpha", "beta"]) == "alpha, beta"
    assert doctorreport.host_names(["h1", "h3"]) == "h1, h3"  # no range: a plain list
    # a name that is a command's argument is never replaced by "each host"
    cmd = [Finding(h, "env", WARN, "stale", f"ssh {h} rm -rf /tmp/ompi.1") for h in ("h1", "h2")]
    assert [g.hosts for g in doctorreport.group_findings(cmd)] == [("h1",), ("h2",)]
    # hnode1 is not hnode10
    near = [Finding(h, "env", WARN, f"x on {h}; hnode10 too") for h in ("hnode1", "hnode2")]
    assert [g.hosts for g in doctorreport.group_findings(near)] == [("hnode1", "hnode2")]


def test_doctor_text_shows_each_finding_once_and_json_stays_per_host(capsys):
    hosts, found = _four_hosts()
    report = doctorreport.DoctorReport(hosts, found, timings={"total": 1.0})
    doctorreport.render(report)
    out = capsys.readouterr().out
    blocks = [ln for ln in out.splitlines() if ln[:2] in ("! ", "✗ ")]
    assert blocks == [
        "! hnode[1-4] [env] prted is not on each host's non-interactive PATH (/usr/bin:/bin)",
        "! hnode[1-4] [network] docker0 (172.17.0.1/16) carries the same address on hnode1, hnode2, hnode3, "
        "hnode4: MPI can hang",
        "✗ hnode3 [env] the program /x.py does not exist on hnode3"]
    assert out.rstrip().splitlines()[-1].startswith("doctor: 4 hosts, 1 failed, 2 warnings")
    data = report.to_dict()
    assert len([f for f in data["findings"] if f["check"] == "network"]) == 4
    assert [f["detail"] for f in data["findings"] if f["host"] == "hnode2" and f["check"] == "env"] == \
        ["prted is not on hnode2's non-interactive PATH (/usr/bin:/bin)"]
