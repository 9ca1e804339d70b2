"""Hostile paths, ssh settings and known_hosts files against real hosts (network namespaces, real sshd).

Nothing is mocked: real dtrun, real mpirun (Open MPI 5 from the venv, and Debian's Open MPI 4
and MPICH where installed), real ssh to the namespace hosts.
"""
import os
import re
import subprocess

import pytest

from tests.dtrun_helpers import DTRUN, dtrun, user_env

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

SHOW = "echo RANK $DTRUN_RANK on $(hostname)"
FLAVORS = [None, "/usr/bin/mpirun.openmpi", "/usr/bin/mpirun.mpich"]


def ssh_config_with(cluster, known_hosts, path):
    """The cluster's ssh config, with its own known_hosts file, written to ``path``."""
    text = cluster.ssh_config.read_text().replace(str(cluster.known_hosts), str(known_hosts))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def ranks_by_host(stdout):
    return sorted(re.findall(r"RANK (\d+) on (\S+)", stdout))


def host_list(cluster):
    return ",".join(f"{h.name}:1" for h in cluster.hosts)


def flavor_args(mpirun):
    if mpirun is None:
        return []
    if not os.path.exists(mpirun):
        pytest.skip(f"{mpirun} not installed")
    return ["--mpirun", mpirun]


@pytest.mark.parametrize("mpirun", FLAVORS)
def test_launch_with_a_space_in_the_ssh_config_path_and_the_cache(cluster3, tmp_path, mpirun):
    """Open MPI splits plm_ssh_args on spaces: dtrun hands it a config under a plain path that includes the user's."""
    extra = flavor_args(mpirun)
    if mpirun and "mpich" in mpirun:
        # Hydra's proxies call back to this host by its name, which maps to loopback here: name the bridge.
        extra += ["--mpi-args", f"-iface {cluster3.bridge}"]
    cfg = ssh_config_with(cluster3, cluster3.known_hosts, tmp_path / "conf dir" / "ssh config")
    env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache dir"))
    p = dtrun(*extra, "--ssh-config", cfg, "-H", host_list(cluster3), "/bin/sh", "-c", SHOW, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert ranks_by_host(p.stdout) == [(str(i), h.name) for i, h in enumerate(cluster3.hosts)]


def test_cluster_file_identity_under_a_space_reaches_ssh(cluster3, tmp_path):
    key_dir = tmp_path / "key dir"
    key_dir.mkdir()
    key = key_dir / "id ed25519"
    key.write_bytes(cluster3.client_key.read_bytes())
    key.chmod(0o600)
    base = cluster3.ssh_config.read_text().replace(f"IdentityFile {cluster3.client_key}", "")
    cfg = tmp_path / "base_config"
    cfg.write_text(base)
    cf = tmp_path / "cluster.yaml"
    cf.write_text(f"ssh_config: {cfg}\ndefaults: {{identity_file: '{key}', user: root}}\n"
                  "hosts: [" + ", ".join(h.name for h in cluster3.hosts) + "]\n")
    env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache dir"))
    p = dtrun("--cluster", cf, "/bin/sh", "-c", SHOW, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert [h for _, h in ranks_by_host(p.stdout)] == [h.name for h in cluster3.hosts]


def test_no_field_or_option_runs_a_command(cluster3, tmp_path):
    """ProxyCommand payloads through every cluster-file field and every option that reaches ssh or mpirun,
    with the files they name existing: each is refused (exit 2, one line) and nothing is created."""
    marker = "hd-pwned"
    good_cfg = ssh_config_with(cluster3, cluster3.known_hosts, tmp_path / "good_config")
    # Paths that exist and hold a payload in their names.
    evil_id = tmp_path / f'id"\nProxyCommand touch {marker}\nX "'
    evil_id.write_text("")
    evil_cfg = tmp_path / f"cfg -oProxyCommand=touch${{IFS}}{marker}"
    evil_cfg.write_text(good_cfg.read_text())
    hosts = ", ".join(h.name for h in cluster3.hosts)
    import json
    cluster_files = {
        "identity_file": f"defaults: {{identity_file: {json.dumps(str(evil_id))}}}\nhosts: [{hosts}]\n",
        "ssh_config": f"ssh_config: {json.dumps(str(evil_cfg))}\nhosts: [{hosts}]\n",
        "name": f"hosts: [{json.dumps(cluster3.hosts[0].name + chr(10) + 'ProxyCommand touch ' + marker)}]\n",
        "user": f"defaults: {{user: {json.dumps('root' + chr(10) + 'ProxyCommand touch ' + marker)}}}\nhosts: [{hosts}]\n",
        "port": f"defaults: {{port: {json.dumps('22' + chr(10) + 'ProxyCommand touch ' + marker)}}}\nhosts: [{hosts}]\n",
        "zone id": f"hosts: [{json.dumps('fe80::1%eth0' + chr(10) + 'ProxyCommand touch ' + marker)}]\n",
    }
    runs = []
    for field, text in cluster_files.items():
        cf = tmp_path / f"{field.replace(' ', '_')}.yaml"
        cf.write_text(text)
        runs += [(field, ["--cluster", cf, "/bin/true"]), (field + " (doctor)", ["doctor", "--cluster", cf, "--timeout", "2"])]
    hl = host_list(cluster3)
    runs += [
        ("--ssh-config", ["--ssh-config", evil_cfg, "-H", hl, "/bin/true"]),
        ("--ssh-config (doctor)", ["doctor", "--ssh-config", evil_cfg, "-H", hl, "--timeout", "2"]),
        ("--mca", ["--ssh-config", good_cfg, "-H", hl, "--mca", "plm_ssh_args", f"-oProxyCommand=touch${{IFS}}{marker}",
                   "/bin/true"]),
        ("--mca value", ["--ssh-config", good_cfg, "-H", hl, "--mca", "btl", f"$(touch {marker})", "/bin/true"]),
        ("-H", ["--ssh-config", good_cfg, "-H", f"-oProxyCommand=touch {marker}", "/bin/true"]),
        ("-x", ["--ssh-config", good_cfg, "-H", hl, "-x", f"A=1\nProxyCommand touch {marker}", "/bin/true"]),
        ("--include-iface", ["--ssh-config", good_cfg, "-H", hl, "--include-iface", f"eth0;touch {marker}", "/bin/true"]),
        ("--log-dir", ["--ssh-config", good_cfg, "-H", hl, "--log-dir", f"x\ntouch {marker}", "/bin/true"]),
    ]
    env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    for label, argv in runs:
        p = dtrun(*argv, cwd=tmp_path, env=env, timeout=120)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (label, p.stdout, p.stderr)
        assert not (tmp_path / marker).exists(), label
    # keyscan reads the config with paramiko only (no OpenSSH, no shell): it works, and runs nothing
    k = dtrun("keyscan", "--ssh-config", evil_cfg, "--yes", cluster3.hosts[0].name, cwd=tmp_path, env=env)
    assert k.returncode == 0 and "already in" in k.stdout, k.stdout + k.stderr
    for dry in [["--dry-run"] + argv for label, argv in runs if argv[0] not in ("doctor", "keyscan")]:
        p = dtrun(*dry, cwd=tmp_path, env=env)
        assert p.returncode == 2, p.stdout + p.stderr
    assert not (tmp_path / marker).exists()
    assert not (tmp_path / "cache" / "dtrun" / "ssh").exists()


def _known_lines(cluster):
    return cluster.known_hosts.read_text().splitlines()


def test_bad_known_hosts_lines_are_skipped_like_openssh_does(cluster3, tmp_path):
    kh = tmp_path / "known_hosts"
    first = _known_lines(cluster3)[0].split()
    kh.write_text("garbage line\n" "h ssh-ed25519 !!!\n" f"@cert-authority *.example {first[1]} {first[2]}\n"
                  + "\n".join(_known_lines(cluster3)) + "\n")
    cfg = ssh_config_with(cluster3, kh, tmp_path / "cfg")
    # OpenSSH itself connects with this file
    ok = subprocess.run(["ssh", "-F", str(cfg), cluster3.hosts[0].name, "true"], capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    d = dtrun("doctor", "--ssh-config", cfg, "-H", host_list(cluster3), "--no-e2e", "--timeout", "3", timeout=120)
    assert d.returncode == 0 and "Traceback" not in d.stderr, d.stdout + d.stderr
    p = dtrun("--ssh-config", cfg, "-H", host_list(cluster3), "/bin/sh", "-c", SHOW, timeout=120,
              env=user_env(XDG_CACHE_HOME=str(tmp_path / "cache")))
    assert p.returncode == 0, p.stderr
    assert len(ranks_by_host(p.stdout)) == 3


def test_a_revoked_host_key_is_refused_by_doctor_preflight_and_keyscan(cluster3, tmp_path):
    kh = tmp_path / "known_hosts"
    lines = _known_lines(cluster3)
    names, ktype, b64 = lines[0].split()
    kh.write_text("\n".join(lines) + f"\n@revoked {names} {ktype} {b64}\n")
    before = kh.read_bytes()
    cfg = ssh_config_with(cluster3, kh, tmp_path / "cfg")
    h1 = cluster3.hosts[0].name
    # OpenSSH refuses it too
    ossh = subprocess.run(["ssh", "-F", str(cfg), h1, "true"], capture_output=True, text=True, timeout=30)
    assert ossh.returncode != 0 and "REVOKED" in ossh.stderr.upper(), ossh.stderr
    d = dtrun("doctor", "--ssh-config", cfg, "-H", host_list(cluster3), "--no-e2e", "--timeout", "3", timeout=120)
    assert d.returncode == 1 and "Traceback" not in d.stderr, d.stderr
    assert re.search(rf"✗ {re.escape(h1)} \[ssh\] .*@revoked", d.stdout), d.stdout
    p = dtrun("--ssh-config", cfg, "-H", host_list(cluster3), "/bin/true", timeout=120,
              env=user_env(XDG_CACHE_HOME=str(tmp_path / "cache")))
    assert p.returncode == 1 and f"dtrun: preflight: {h1}" in p.stderr and "@revoked" in p.stderr, p.stderr
    k = dtrun("keyscan", "--ssh-config", cfg, "--yes", h1, timeout=60)
    assert k.returncode == 1 and "@revoked" in k.stdout, k.stdout + k.stderr
    assert kh.read_bytes() == before


def test_keyscan_with_stdin_closed_and_a_file_without_final_newline(cluster3, tmp_path):
    kh = tmp_path / "known_hosts"
    lines = _known_lines(cluster3)
    kh.write_text(lines[0])  # h1 known, no final newline; h2 and h3 unknown
    cfg = ssh_config_with(cluster3, kh, tmp_path / "cfg")
    h2, h3 = cluster3.hosts[1].name, cluster3.hosts[2].name
    closed = subprocess.run(["bash", "-c", f'exec "$0" keyscan --ssh-config "$1" "$2" <&-', DTRUN, str(cfg), h2],
                            capture_output=True, text=True, timeout=60, env=user_env())
    assert closed.returncode == 1 and "Traceback" not in closed.stderr, closed.stdout + closed.stderr
    assert f"{h2}: not added" in closed.stdout
    assert kh.read_text() == lines[0]
    added = dtrun("keyscan", "--ssh-config", cfg, "--yes", h2, h3, timeout=60)
    assert added.returncode == 0, added.stdout + added.stderr
    got = kh.read_text().splitlines()
    assert got[0] == lines[0] and len(got) == 3  # the first entry is intact, each key on its own line
    d = dtrun("doctor", "--ssh-config", cfg, "-H", host_list(cluster3), "--no-e2e", "--timeout", "3", timeout=120)
    assert d.returncode == 0, d.stdout + d.stderr


def _cmdlines_with(token):
    import psutil
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(token in part for part in (proc.info["cmdline"] or [])):
                found.append(" ".join(proc.info["cmdline"])[:120])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def test_x_name_keeps_the_value_off_every_command_line(cluster3, tmp_path):
    """All namespace hosts share this machine's process table, so one scan sees every host's processes."""
    import time
    secret = f"hd-secret-{os.getpid()}-{time.monotonic_ns()}"
    env = user_env(HD_BY_NAME=secret, XDG_CACHE_HOME=str(tmp_path / "cache"))
    prog = "echo RANK $DTRUN_RANK on $(hostname) $HD_BY_NAME; sleep 3"
    proc = subprocess.Popen([DTRUN, "--ssh-config", str(cluster3.ssh_config), "-H", host_list(cluster3),
                             "-x", "HD_BY_NAME", "/bin/sh", "-c", prog], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    seen, scans = [], 0
    try:
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            seen += _cmdlines_with(secret)
            scans += 1
            time.sleep(0.2)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert sorted(re.findall(r"RANK (\d) on \S+ (\S+)", out)) == [(str(i), secret) for i in range(3)]
    assert scans >= 5 and seen == [], seen
    # The scan does see a value given as -x NAME=VALUE (what README warns about).
    shown = f"{secret}-shown"
    proc = subprocess.Popen([DTRUN, "--ssh-config", str(cluster3.ssh_config), "-H", host_list(cluster3),
                             "-x", f"HD_BY_VALUE={shown}", "/bin/sh", "-c", "sleep 3"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    visible = []
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline and not visible:
            visible = _cmdlines_with(shown)
            time.sleep(0.2)
    finally:
        proc.wait(timeout=60)
    assert visible


def test_dry_run_with_the_preflight_writes_nothing(cluster3, tmp_path):
    """A dry run checks the hosts like a launch, and leaves no preflight cache, flavor cache or ssh config."""
    cfg = ssh_config_with(cluster3, cluster3.known_hosts, tmp_path / "conf dir" / "ssh config")
    env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    p = dtrun("--dry-run", "--ssh-config", cfg, "-H", host_list(cluster3), "/bin/true", env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"# a launch first writes {tmp_path / 'cache' / 'dtrun' / 'ssh' / 'config-'}" in p.stdout
    assert not (tmp_path / "cache").exists(), sorted(map(str, (tmp_path / "cache").rglob("*")))
