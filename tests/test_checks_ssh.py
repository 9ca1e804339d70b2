"""ssh config resolution, host-key verdicts, the probe's boot line and local run, keyscan and preflight pieces."""
import io
import json
import os
import stat
import subprocess
import sys
import time

import paramiko
import pytest

from dtrun.checks import keyscan, knownhosts, preflight, probesession, sshtarget
from dtrun.checks.errors import CheckTimeout, HostKeyChanged, HostKeyUnknown
from dtrun.launcher.hostfile import HostSlots

CONFIG = """
Host h1
    HostName 10.0.0.11
    User alice
    Port 2222
    IdentityFile ~/keys/id_h1
    IdentitiesOnly yes
    UserKnownHostsFile /tmp/kh1 /tmp/kh2
    GlobalKnownHostsFile /dev/null
Host h2
    HostKeyAlias cluster-h2
"""


def config(text=CONFIG):
    return paramiko.SSHConfig.from_text(text)


def test_ssh_target_follows_the_config():
    t = sshtarget.ssh_target("h1", config(), "/cfg")
    assert (t.name, t.hostname, t.port, t.user) == ("h1", "10.0.0.11", 2222, "alice")
    assert t.identity_files == (os.path.expanduser("~/keys/id_h1"),) and t.identities_only
    assert t.known_hosts == ("/tmp/kh1", "/tmp/kh2") and t.global_known_hosts == ("/dev/null",)
    assert t.known_hosts_name == "[10.0.0.11]:2222"
    assert t.where == "h1 (10.0.0.11:2222)"
    h2 = sshtarget.ssh_target("h2", config())
    assert h2.known_hosts_name == "cluster-h2" and h2.port == 22
    assert h2.known_hosts == tuple(os.path.expanduser(p) for p in sshtarget.DEFAULT_KNOWN_HOSTS)


def test_cluster_file_settings_win_over_the_config():
    t = sshtarget.ssh_target(HostSlots("h1", 2, user="ops", port=2200, identity_file="/k/ops"), config())
    assert (t.user, t.port, t.identity_files[0]) == ("ops", 2200, "/k/ops")


def test_host_key_verdicts(tmp_path):
    key, other = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    target = sshtarget.SshTarget("h1", "10.0.0.11", known_hosts=(str(tmp_path / "kh"),), global_known_hosts=(),
                           config="/cfg")
    with pytest.raises(HostKeyUnknown) as unknown:
        knownhosts.verify_host_key(target, key, None, {})
    assert key.fingerprint in unknown.value.detail
    assert unknown.value.fix.endswith("`dtrun keyscan --ssh-config /cfg h1`")
    (tmp_path / "kh").write_text(keyscan.known_hosts_line("10.0.0.11", key))
    known_file, known = knownhosts.known_host_keys(target)
    assert known_file == str(tmp_path / "kh")
    knownhosts.verify_host_key(target, key, known_file, known)  # matches: no exception
    with pytest.raises(HostKeyChanged) as changed:
        knownhosts.verify_host_key(target, other, known_file, known)
    text = changed.value.detail
    assert text.startswith("HOST KEY CHANGED") and other.fingerprint in text and key.fingerprint in text
    assert "ssh-keygen -R '10.0.0.11'" in changed.value.fix


def test_append_known_host_creates_private_file(tmp_path):
    path = tmp_path / "new" / "known_hosts"
    keyscan.append_known_host(str(path), "h1 ssh-ed25519 AAAA\n")
    keyscan.append_known_host(str(path), "h2 ssh-ed25519 BBBB\n")
    assert path.read_text() == "h1 ssh-ed25519 AAAA\nh2 ssh-ed25519 BBBB\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_keyscan_asks_and_takes_only_yes():
    out = io.StringIO()
    assert keyscan.ask("add? ", io.StringIO("y\n"), out) and out.getvalue() == "add? "
    assert not keyscan.ask("add? ", io.StringIO("\n"), io.StringIO())
    assert not keyscan.ask("add? ", io.StringIO(""), io.StringIO())  # EOF means no


def test_boot_command_quotes_the_path_and_is_otherwise_fixed():
    cmd = probesession.boot_command("/opt/my env/bin/python'; rm -rf /")
    assert "'/opt/my env/bin/python'\"'\"'; rm -rf /'" in cmd
    assert probesession.boot_command("/x/python").replace("/x/python", "P") == probesession.boot_command("/y/python").replace("/y/python", "P")


def run_probe_via_shell(job_python, path, request):
    """The probe as a remote shell would start it: `sh -c BOOT_LINE` with the source on stdin."""
    p = subprocess.run(["/bin/sh", "-c", probesession.boot_command(job_python)], input=probesession.probe_input(request),
                       capture_output=True, timeout=30, env={"PATH": path, "HOME": "/root"})
    return p.returncode, p.stdout, p.stderr


def test_probe_falls_back_to_system_python_on_a_broken_path():
    rc, out, err = run_probe_via_shell("/nonexistent/venv/bin/python", "/usr/bin:/bin",
                                       {"paths": {"python": "/nonexistent/venv/bin/python", "cwd": "/"}})
    assert rc == 0, err
    rep = json.loads(out.splitlines()[0])
    assert rep["env"]["PATH"] == "/usr/bin:/bin" and rep["env"]["LD_LIBRARY_PATH"] is None
    assert rep["python"]["is_job_python"] is False
    assert rep["paths"]["python"]["exists"] is False and rep["paths"]["cwd"]["isdir"] is True
    assert rep["which"]["prted"] is None
    assert rep["interfaces"]["source"] in ("ip", "sysfs")


def test_local_probe_reports_and_connects():
    req = {"paths": {"python": sys.executable, "cwd": os.getcwd(), "program": "/nonexistent.py"},
           "launch_path": os.environ["PATH"], "listen": True}
    p = probesession.LocalProbe("localhost", req)
    try:
        rep = p.read(30, "probe")
        assert rep["python"]["is_job_python"] and rep["python"]["mpi4py"]
        assert rep["paths"]["program"]["exists"] is False and rep["port"]
        p.send({"connect": [["self", "127.0.0.1", rep["port"]], ["closed", "127.0.0.1", 1]], "timeout": 2})
        pairs = p.read(10, "pairs")
        assert pairs["connect"]["self"][0] == "ok" and pairs["connect"]["closed"][0] == "refused"
        with pytest.raises(CheckTimeout):
            p.read(0.2, "nothing")  # no third line: the wait is bounded
    finally:
        p.close()
    assert p.proc.returncode == 0


def test_preflight_result_is_a_choice_and_leaves_the_options_alone():
    assert preflight.choice_of(preflight.PreflightResult((), None, None)) is None
    choice = preflight.choice_of(preflight.PreflightResult((), "10.0.0.0/24", "=eth0"))
    assert (choice.include, choice.nccl) == ("10.0.0.0/24", "=eth0")
    assert choice.reason == "subnet 10.0.0.0/24 shared by all hosts, found by the preflight"


def test_preflight_cache_expires(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    hosts = (HostSlots("h1"), HostSlots("h2"))
    key = preflight.cache_key(hosts, None)
    assert key != preflight.cache_key((HostSlots("h1"),), None)
    assert preflight.read_cache(key) is None
    preflight.write_cache(key, preflight.PreflightResult((), "10.0.0.0/24", "=eth0"))
    hit = preflight.read_cache(key)
    assert (hit.include, hit.nccl) == ("10.0.0.0/24", "=eth0")
    assert preflight.read_cache(key, now=time.time() + preflight.CACHE_TTL_S + 1) is None


def test_fan_out_answers_for_every_host_and_never_stops_at_a_failure():
    from types import SimpleNamespace

    from dtrun.checks.errors import ConnectTimeout
    from dtrun.checks.result import FAIL
    from dtrun.checks.fanout import fan_out

    def work(t):
        if t.name.startswith("bad"):
            raise ConnectTimeout(t.name, f"TCP to {t.name}:22 timed out", "check the host")
        return t.name.upper()

    hosts = [SimpleNamespace(name=n) for n in ("a", "bad1", "b", "bad2")]
    res = fan_out(hosts, work)
    assert res.ok == {"a": "A", "b": "B"}
    assert list(res.failed) == ["bad1", "bad2"]
    [f1, f2] = res.findings("ssh")
    assert (f1.host, f1.check, f1.status, f1.detail, f1.fix) == ("bad1", "ssh", FAIL, "TCP to bad1:22 timed out",
                                                                 "check the host")
    assert [f.check for f in res.findings(lambda h: "env" if h == "bad2" else "ssh")] == ["ssh", "env"]
