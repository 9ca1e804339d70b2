"""The one gate (launcher/safe.py) and the files written from it, on values: every field, every consumer."""
import os

import pytest

from dtrun.launcher import safe, sshconf
from dtrun.launcher.errors import HostfileError, InvalidValue, UsageError
from dtrun.launcher.hostfile import HostSlots, parse_cluster_yaml, parse_host_list, parse_hostfile, slurm_hosts
from dtrun.launcher.hosts import HostSelection

# Values an attacker or a typo puts into a field; none may pass any grammar.
HOSTILE = [
    "a\nProxyCommand touch /tmp/x", "a\n", "a\r", "a b", 'a"b', "a\\b", "$(touch x)", "`id`", "a;b", "-oX=y",
    "a\x00b", "a\tb", "a#b", "a'b", "%h", "${HOME}", "*", "a,b",
]


@pytest.mark.parametrize("name", [
    "node1", "n-1.example.com", "a_b", "10.0.0.1", "::1", "fe80::1%eth0", "fe80::1%1", "2001:db8::5", "x" * 63,
])
def test_host_names_that_pass(name):
    assert safe.host_name(name) == name


@pytest.mark.parametrize("name", HOSTILE + [
    "999.1.1.1", "1.2.3.4.5", "10", "256.0.0.1", "fe80::1%eth0 x", "fe80::1%eth0\n", "fe80::1%$(id)", "fe80::1%",
    "fe80::1%a;b", ":::", "-a", "a-", "x" * 64, ".a", "a..b", "é.com", "",
])
def test_host_names_that_fail(name):
    with pytest.raises(InvalidValue):
        safe.host_name(name)


def test_trailing_newline_is_not_a_name():
    """re.match(r'...$') accepts 'node1\\n' because '$' matches before a final newline; fullmatch does not."""
    with pytest.raises(InvalidValue):
        safe.host_name("node1\n")
    for entry in ('"node1\\n"', '{name: "node1\\n"}', '{name: a, user: "root\\n"}'):
        with pytest.raises(HostfileError):
            parse_cluster_yaml(f"hosts:\n  - {entry}\n", "c.yaml")
    with pytest.raises(HostfileError):
        parse_host_list("[fe80::1%eth0\n]:1")


@pytest.mark.parametrize("text, why", [
    ("4", None), ("4096", None), ("0", "positive"), ("-2", "positive"), ("4097", "at most 4096"),
    ("10" + "0" * 29, "at most"), ("٣", "'٣'"), ("1_0", "'1_0'"), ("+4", "'+4'"), (" 4", "' 4'"), ("4.0", "'4.0'"),
    ("", "''"),
])
def test_counts_are_ascii_digits_and_bounded(text, why):
    if why is None:
        assert safe.count(text, "slots", safe.MAX_SLOTS) == int(text)
    else:
        with pytest.raises(InvalidValue) as e:
            safe.count(text, "slots", safe.MAX_SLOTS)
        assert why in str(e.value)


@pytest.mark.parametrize("value", ["root", "mpi.user", "a-b_c"])
def test_user_names_that_pass(value):
    assert safe.user_name(value) == value


@pytest.mark.parametrize("value", HOSTILE + ["root\n", "x" * 33, ""])
def test_user_names_that_fail(value):
    with pytest.raises(InvalidValue):
        safe.user_name(value)


def test_mca_keys_and_values():
    assert safe.mca_key("btl_tcp_if_include") == "btl_tcp_if_include"
    assert safe.mca_value("btl", "^openib") == "^openib"
    assert safe.mca_value("x", "10.0.0.0/24,lo") == "10.0.0.0/24,lo"
    for key in ["", "1btl", "a b", "btl\n", "a-b", "a=b", "-x"]:
        with pytest.raises(InvalidValue):
            safe.mca_key(key)
    for value in ["$(id)", "`id`", "a;b", "*", "a?", 'a"b', "a'b", "a\nb", "a|b", "a&b", "a>b", "a\\b"]:
        with pytest.raises(InvalidValue):
            safe.mca_value("k", value)


def test_env_items():
    assert safe.env_item("FOO") == ("FOO", None)
    assert safe.env_item("FOO=a b=c") == ("FOO", "a b=c")
    for item in ["1A=b", "A B=c", "A\n=b", "A=b\nc", "A=\x1b[31m", "=x", ""]:
        with pytest.raises(InvalidValue):
            safe.env_item(item)


def test_interfaces_and_subnets():
    assert safe.iface("eth0", "--include-iface") == "eth0"
    assert safe.iface("10.1.2.3/24", "--include-iface") == "10.1.2.0/24"
    for bad in ["eth0;x", "e th0", "x" * 16, "10.0.0.0/99", "", "eth0\n", "$(id)"]:
        with pytest.raises(InvalidValue):
            safe.iface(bad, "--include-iface")


@pytest.mark.parametrize("value", [1.0, 0.5, 600])
def test_seconds_that_pass(value):
    assert safe.seconds(value, "--timeout") == value


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0, -5, 1e9])
def test_seconds_that_fail(value):
    with pytest.raises(InvalidValue):
        safe.seconds(value, "--timeout")


def test_ssh_config_paths_are_quoted_or_refused():
    assert safe.ssh_config_path("/home/a b/id_ed25519", "identity_file") == '"/home/a b/id_ed25519"'
    for bad in ['/k"\nProxyCommand touch /tmp/x', "/k\n", "/k\\x", "/k/${HOME}", "/k/%h", "/k/*", "/k/?", "/k/["]:
        with pytest.raises(InvalidValue):
            safe.ssh_config_path(bad, "identity_file")


def test_open_mpi_argument_words():
    assert safe.mca_word("/root/.cache/dtrun/ssh/config-0123", "p")
    for bad in ["/a b", "/x -oProxyCommand=touch", "/a\nb", "", "/a'b"]:
        with pytest.raises(InvalidValue):
            safe.mca_word(bad, "ssh config path")


# ---- every field of the cluster file reaches the generated ssh config only through the gate --------

INJECT = '"\n  ProxyCommand touch /tmp/pwned-hd\nHost x\n  User "y'


@pytest.mark.parametrize("field, value", [
    ("name", INJECT), ("name", "fe80::1%x\nProxyCommand touch /tmp/pwned-hd"), ("user", INJECT), ("port", INJECT),
    ("identity_file", INJECT), ("slots", INJECT), ("max_slots", INJECT), ("identity_file", "/k/%d/${X}"),
])
def test_cluster_file_fields_cannot_inject(field, value):
    import json
    entry = {"name": "node1", field: value}
    text = "hosts:\n  - " + json.dumps(entry) + "\n"
    with pytest.raises(HostfileError) as e:
        parse_cluster_yaml(text, "c.yaml")
    assert str(e.value).startswith("c.yaml:2: ")
    defaults = {k: v for k, v in entry.items() if k != "name"}
    if defaults:
        with pytest.raises(HostfileError):
            parse_cluster_yaml("defaults: " + json.dumps(defaults) + "\nhosts: [node1]\n", "c.yaml")


def test_cluster_file_ssh_config_key_cannot_inject():
    for value in ['/x"\nProxyCommand touch /tmp/pwned-hd', "/x/${HOME}"]:
        import json
        with pytest.raises(HostfileError):
            parse_cluster_yaml(f"ssh_config: {json.dumps(value)}\nhosts: [a]\n", "c.yaml")


def test_config_text_holds_each_value_on_its_own_line(tmp_path):
    home = tmp_path / "my home" / ".ssh" / "config"
    home.parent.mkdir(parents=True)
    home.write_text("")
    hosts = [HostSlots("n1", 2, user="ops", port=2222, identity_file=str(tmp_path / "key dir" / "id")),
             HostSlots("fe80::1%eth0", 1, user="u"), HostSlots("plain", 1)]
    text = sshconf.config_text(hosts, None, "c.yaml\nProxyCommand x", home_config=str(home))
    assert text.splitlines() == [
        "# written by dtrun from c.yaml ProxyCommand x",
        "Host n1", "  User ops", "  Port 2222", f'  IdentityFile "{tmp_path}/key dir/id"',
        "Host fe80::1%eth0", "  User u",
        "Host *", f'  Include "{home}"',
    ]
    # A HostSlots built around the parser still cannot get a newline in.
    with pytest.raises(InvalidValue):
        sshconf.config_text([HostSlots("n1\nProxyCommand x", 1, user="u")], None, "x")
    with pytest.raises(InvalidValue):
        sshconf.config_text([HostSlots("n1", 1, identity_file='/k"\nProxyCommand x')], None, "x")


def test_job_files_keep_a_plain_path_for_open_mpi(tmp_path, monkeypatch):
    """A base config under a directory with a space is reached through a generated config with a plain path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache with space"))
    base = tmp_path / "conf dir" / "ssh_config"
    base.parent.mkdir()
    base.write_text("Host *\n  User root\n")
    sel = HostSelection((HostSlots("n1", 1),), "-H")
    files = sshconf.job_ssh_files(sel, str(base), openmpi=True)
    assert safe.mca_word(files.config, "config") and files.config.startswith(f"/tmp/dtrun-{os.geteuid()}/ssh/")
    assert files.files[0].text.endswith(f'Host *\n  Include "{base}"\n')
    assert not os.path.exists(files.config) or files.files[0].text == open(files.config).read()
    hydra = sshconf.job_ssh_files(sel, str(base), openmpi=False)
    assert hydra.wrapper and f"exec ssh -F {hydra.config} \"$@\"" in hydra.files[-1].text
    plain = tmp_path / "plain_config"
    plain.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert sshconf.job_ssh_files(sel, str(plain), openmpi=True).files == ()  # passed as it is


def test_generated_files_go_to_a_private_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    sel = HostSelection((HostSlots("n1", 1, user="ops"),), "-H")
    files = sshconf.job_ssh_files(sel, None, openmpi=False)
    files.write()
    import stat
    for f in files.files:
        mode = stat.S_IMODE(os.stat(f.path).st_mode)
        assert mode == (0o700 if f.executable else 0o600) and open(f.path).read() == f.text
    assert stat.S_IMODE(os.stat(tmp_path / "c" / "dtrun" / "ssh").st_mode) == 0o700


def test_hostfile_and_slurm_values_go_through_the_same_gate():
    with pytest.raises(HostfileError):
        parse_hostfile("node1 slots=1_0\n", "hf")
    with pytest.raises(HostfileError):
        parse_hostfile("999.1.1.1 slots=2\n", "hf")
    for nodelist in ("n[1-100000]", "n[1-99999999999]", "a[1-300]b[1-300]"):
        with pytest.raises(HostfileError) as e:
            slurm_hosts({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": nodelist})
        assert "more than 65536" in str(e.value)
    with pytest.raises(HostfileError) as e:
        slurm_hosts({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "0(x2)"})
    assert str(e.value).startswith("SLURM_TASKS_PER_NODE: '0(x2)' gives no tasks")
    with pytest.raises(HostfileError):
        slurm_hosts({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x999999999)"})
    with pytest.raises(HostfileError):
        slurm_hosts({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "5000(x2)"})


def test_yaml_duplicate_keys_and_deep_nesting():
    with pytest.raises(HostfileError) as e:
        parse_cluster_yaml("hosts:\n  - {name: a, slots: 2, slots: 4}\n", "c.yaml")
    assert str(e.value) == "c.yaml:2: key 'slots' given twice"
    with pytest.raises(HostfileError) as e:
        parse_cluster_yaml("hosts: [a]\nhosts: [b]\n", "c.yaml")
    assert "key 'hosts' given twice" in str(e.value)
    with pytest.raises(HostfileError) as e:
        parse_cluster_yaml("hosts: " + "[" * 5000 + "]" * 5000 + "\n", "c.yaml")
    assert "nested too deeply" in str(e.value)


def test_slurm_hostlist_size_counts_without_expanding():
    from dtrun.launcher.hostfile import hostlist_size
    assert hostlist_size("n[01-04,07]") == 5
    assert hostlist_size("a[1-2]b[1-3],c") == 7
    assert hostlist_size("n[1-100000]") == 100000
    assert hostlist_size("n[1-1000]x[1-1000]") == 10 ** 6


def test_usage_error_tree():
    assert issubclass(InvalidValue, UsageError)
