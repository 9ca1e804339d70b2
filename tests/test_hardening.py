"""Hostile input and a broken network on one host: no hang, no traceback, no command the user did not write.

A silent TCP listener (accepts, never speaks) plays an sshd that never completes the
handshake; real keyscan, doctor and launches run against it through the dtrun script.
"""
import json
import os
import socket
import stat
import subprocess
import threading
import time

import paramiko
import pytest

from dtrun.checks import keyscan, knownhosts, sshtarget
from dtrun.checks.errors import HostKeyChanged, HostKeyRevoked, HostKeyUnknown
from tests.dtrun_helpers import DTRUN, PYTHON, REPO, dtrun, one_line_error, user_env


@pytest.fixture
def silent_sshd():
    """A TCP listener on 127.0.0.1 that accepts connections and never sends a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held, stop = [], threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(2)
    for c in held:
        c.close()
    srv.close()


def config_for(tmp_path, port, known_hosts=None, name="silent"):
    cfg = tmp_path / "ssh_config"
    kh = known_hosts or (tmp_path / "known_hosts")
    cfg.write_text(f"Host {name}\n  HostName 127.0.0.1\n  Port {port}\n  UserKnownHostsFile {kh}\n"
                   f"  GlobalKnownHostsFile /dev/null\n")
    return cfg


# ---- a silent sshd --------------------------------------------------------------------------------

def test_keyscan_against_a_silent_sshd_is_a_finding(tmp_path, silent_sshd):
    cfg = config_for(tmp_path, silent_sshd)
    t0 = time.monotonic()
    p = dtrun("keyscan", "--ssh-config", cfg, "--timeout", "1", "--yes", "silent", timeout=60)
    assert time.monotonic() - t0 < 15
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert "silent:" in p.stdout and ("handshake did not complete" in p.stdout or "greeting" in p.stdout), p.stdout
    assert not (tmp_path / "known_hosts").exists()


def test_doctor_against_a_silent_sshd_names_the_host(tmp_path, silent_sshd):
    cfg = config_for(tmp_path, silent_sshd)
    p = dtrun("doctor", "-H", "silent", "--ssh-config", cfg, "--timeout", "1", "--no-e2e", "--json", timeout=90)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    report = json.loads(p.stdout)
    ssh_findings = [f for f in report["findings"] if f["host"] == "silent" and f["check"] == "ssh"]
    assert ssh_findings and ssh_findings[0]["status"] == "fail"
    assert "127.0.0.1" in ssh_findings[0]["detail"], ssh_findings


def test_launch_preflight_against_a_silent_sshd_stops_with_the_finding(tmp_path, silent_sshd):
    cfg = config_for(tmp_path, silent_sshd)
    t0 = time.monotonic()
    p = dtrun("--ssh-config", cfg, "-H", "silent:1", "true", timeout=90,
              env=user_env(XDG_CACHE_HOME=str(tmp_path / "cache")))
    assert time.monotonic() - t0 < 30
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "dtrun: preflight: silent" in p.stderr


# ---- known_hosts as OpenSSH reads it ---------------------------------------------------------------

def test_known_hosts_bad_lines_and_markers(tmp_path):
    key, other, ca = (paramiko.ECDSAKey.generate() for _ in range(3))
    kh = tmp_path / "kh"
    kh.write_text(
        "garbage\n"
        "h1 ssh-ed25519 !!!notbase64!!!\n"
        "h1 ssh-ed25519 AAAA\n"
        "\xff\xfe binary\n"
        f"@cert-authority *.example {ca.get_name()} {ca.get_base64()}\n"
        f"@revoked * {other.get_name()} {other.get_base64()}\n"
        f"@bogus h1 {ca.get_name()} {ca.get_base64()}\n"
        + keyscan.known_hosts_line("10.0.0.11", key))
    parsed = knownhosts.read_known_hosts(str(kh))
    assert len(parsed.revoked) == 1 and len(parsed.skipped) == 6, parsed.skipped
    assert any("@cert-authority" in s for s in parsed.skipped)
    target = sshtarget.SshTarget("h1", "10.0.0.11", known_hosts=(str(kh),), global_known_hosts=())
    known_file, known = knownhosts.known_host_keys(target)
    knownhosts.verify_host_key(target, key, known_file, known)  # the good line still counts
    with pytest.raises(HostKeyRevoked):
        knownhosts.verify_host_key(target, other, known_file, known)


def test_a_revoked_key_is_refused_even_when_also_listed(tmp_path):
    key = paramiko.ECDSAKey.generate()
    kh = tmp_path / "kh"
    kh.write_text(keyscan.known_hosts_line("h1", key) + f"@revoked h1,h2 {key.get_name()} {key.get_base64()}\n")
    target = sshtarget.SshTarget("h1", "h1", known_hosts=(str(kh),), global_known_hosts=())
    known_file, known = knownhosts.known_host_keys(target)
    with pytest.raises(HostKeyRevoked) as e:
        knownhosts.verify_host_key(target, key, known_file, known)
    assert "@revoked" in e.value.detail
    other = sshtarget.SshTarget("h3", "h3", known_hosts=(str(kh),), global_known_hosts=())
    with pytest.raises(HostKeyUnknown):  # the revocation names h1,h2 only
        knownhosts.verify_host_key(other, key, *knownhosts.known_host_keys(other))


def test_keyscan_appends_after_a_file_without_final_newline(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text("h1 ssh-ed25519 AAAA")  # no final newline
    keyscan.append_known_host(str(path), "h2 ssh-ed25519 BBBB\n")
    assert path.read_text() == "h1 ssh-ed25519 AAAA\nh2 ssh-ed25519 BBBB\n"
    keyscan.append_known_host(str(path), "h3 ssh-ed25519 CCCC\n")
    assert path.read_text().splitlines() == ["h1 ssh-ed25519 AAAA", "h2 ssh-ed25519 BBBB", "h3 ssh-ed25519 CCCC"]


def test_keyscan_question_with_stdin_closed():
    import io
    assert not keyscan.ask("add? ", None, io.StringIO())
    closed = io.StringIO()
    closed.close()
    assert not keyscan.ask("add? ", closed, io.StringIO())


# ---- malformed ssh configs and timeouts ------------------------------------------------------------

@pytest.mark.parametrize("content, needle", [
    (b"\x00\x01\x02\xff\xfe binary", "binary"),
    (b"Host x\n  Port abc\n", "Port 'abc'"),
    (b"Host x\n  ProxyJump\n", "cannot parse"),
    (b"Host x\n  IdentityFile\n", "cannot parse"),
])
def test_malformed_ssh_configs_are_one_line(tmp_path, content, needle):
    cfg = tmp_path / "cfg"
    cfg.write_bytes(content)
    for argv in (["doctor", "-H", "x", "--no-e2e"], ["keyscan", "--yes", "x"]):
        p = dtrun(*argv, "--ssh-config", cfg, "--timeout", "1", timeout=60)
        one_line_error(p, str(cfg), needle)
    p = dtrun("--ssh-config", cfg, "-H", "x:1", "true", timeout=60, env=user_env(XDG_CACHE_HOME=str(tmp_path / "c")))
    one_line_error(p, str(cfg))


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_timeouts_must_be_finite_and_positive(value):
    one_line_error(dtrun("doctor", "-H", "localhost", "--timeout", value), "--timeout must be positive and finite")
    one_line_error(dtrun("keyscan", "--timeout", value, "somehost"), "--timeout must be positive and finite")


def test_e2e_timeout_must_be_positive():
    one_line_error(dtrun("doctor", "-H", "localhost", "--e2e-timeout", "-5"), "--e2e-timeout must be")


# ---- files that are not host files -----------------------------------------------------------------

def test_fifo_and_devices_are_refused_without_hanging(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for flag in ("--hostfile", "--cluster"):
        one_line_error(dtrun("--dry-run", flag, fifo, "true", timeout=20), f"{fifo}: is a FIFO, not a regular file")
        one_line_error(dtrun("--dry-run", flag, "/dev/zero", "true", timeout=20), "/dev/zero: is a device")
        one_line_error(dtrun("hosts", flag, "/dev/urandom", timeout=20), "/dev/urandom: is a device")
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(64 << 20)
    one_line_error(dtrun("--dry-run", "--hostfile", big, "true", timeout=20), "a host file is at most")


# ---- DNS, caches, --dry-run ------------------------------------------------------------------------

def test_many_hosts_with_slow_dns_neither_crash_nor_wait(monkeypatch):
    """A DNS server that takes 3 s per name cannot be set up here without changing the machine's
    resolver for everyone, so getaddrinfo is replaced by one that sleeps (the only stand-in here)."""
    from dtrun.launcher import netinfo

    def slow(*args, **kwargs):
        time.sleep(3)
        raise socket.gaierror("slow")

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    names = [f"node{i}" for i in range(40)]
    t0 = time.monotonic()
    got = netinfo.resolve_all(names, timeout=0.3)
    assert time.monotonic() - t0 < 1.5
    assert got == {n: None for n in names}
    assert netinfo.infer_shared_subnet(names, timeout=0.2) is None


def test_dry_run_with_many_unresolvable_hosts_is_quick(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("".join(f"hd-no-such-host-{i}.invalid slots=1\n" for i in range(40)))
    t0 = time.monotonic()
    # (the preflight, which a dry run also runs, bounds its own DNS step by its timeout)
    p = dtrun("--dry-run", "--no-preflight", "--hostfile", hf, "true", timeout=60)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("content", ["[]", "null", '{"x": 1}', '{"k": {"kind": "x"}}', "{", "\x00"])
def test_corrupt_flavor_cache_is_discarded(tmp_path, content):
    cache = tmp_path / "dtrun"
    cache.mkdir()
    (cache / "mpi-flavors.json").write_text(content)
    env = user_env(XDG_CACHE_HOME=str(tmp_path))
    p = dtrun("--dry-run", "-H", "localhost:1", "true", env=env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    p = dtrun("-H", "localhost:1", "true", env=env, timeout=60)  # a real launch rewrites it
    assert p.returncode == 0, p.stderr
    assert isinstance(json.loads((cache / "mpi-flavors.json").read_text()), dict)


def test_dry_run_changes_nothing_on_disk(tmp_path):
    env = user_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    cf = tmp_path / "c.yaml"
    cf.write_text("hosts:\n  - {name: node1, user: ops, port: 2222, identity_file: /k/id}\n")
    for argv in (["--cluster", cf], ["--cluster", cf, "--mpirun", "/usr/bin/mpirun.mpich"], ["-H", "localhost:1"]):
        if "/usr/bin/mpirun.mpich" in argv and not os.path.exists("/usr/bin/mpirun.mpich"):
            continue
        p = dtrun("--dry-run", "--no-preflight", *argv, "true", env=env)
        assert p.returncode == 0, p.stderr
        assert not (tmp_path / "cache").exists(), list((tmp_path / "cache").rglob("*"))
    assert "# a launch first writes " in p.stdout or argv[0] == "-H"


# ---- what the user sees ----------------------------------------------------------------------------

@pytest.mark.mpi
def test_a_program_that_does_not_exist_is_named():
    p = dtrun("-np", "2", "-H", "localhost:2", "hd-no-such-program", "--flag", timeout=60)
    assert p.returncode == 127, p.stderr
    assert f"dtrun: job failed: hd-no-such-program: command not found on {os.uname().nodename}" in p.stderr


def test_secrets_are_redacted_by_name_and_inside_mpi_args():
    p = dtrun("--dry-run", "-H", "localhost:1", "-x", "DB_PASS=pw1", "-x", "GITHUB_PAT=pw2", "-x", "X_AUTH=pw3",
              "-x", "OPENAI_API_BASE=pw4", "-x", "PATH_HINT=visible",
              "--mpi-args", "-x MY_TOKEN=pw5 -x DB_URL=postgres://u:pw6@db/x", "true")
    assert p.returncode == 0, p.stderr
    for secret in ("pw1", "pw2", "pw3", "pw4", "pw5", "pw6"):
        assert secret not in p.stdout, p.stdout
    assert "DB_PASS=<redacted>" in p.stdout and "PATH_HINT=visible" in p.stdout
    assert "postgres://u:<redacted>@db/x" in p.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("mpirun", [None, "/usr/bin/mpirun.openmpi", "/usr/bin/mpirun.mpich"])
def test_x_name_forwards_a_value_without_showing_it(mpirun):
    """-x NAME puts only the name on mpirun's command line (so not in ps), for every flavor."""
    if mpirun and not os.path.exists(mpirun):
        pytest.skip(f"{mpirun} not installed")
    extra = ["--mpirun", mpirun] if mpirun else []
    env = user_env(HD_FORWARDED="value-by-name")
    dry = dtrun("--dry-run", *extra, "-np", "1", "-H", "localhost:1", "-x", "HD_FORWARDED", "true", env=env)
    assert dry.returncode == 0 and "value-by-name" not in dry.stdout and "HD_FORWARDED" in dry.stdout, dry.stdout
    p = dtrun(*extra, "-np", "1", "-H", "localhost:1", "-x", "HD_FORWARDED", "/bin/sh", "-c",
              "echo got=$HD_FORWARDED", env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "got=value-by-name" in p.stdout


@pytest.mark.parametrize("content", ["[]", "null", '{"time": "x"}', "{", '"text"'])
def test_corrupt_preflight_cache_entry_is_ignored(tmp_path, monkeypatch, content):
    from dtrun.checks import preflight
    from dtrun.launcher.hostfile import HostSlots
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = preflight.cache_key((HostSlots("h1"),), None)
    path = tmp_path / "dtrun" / "preflight" / f"{key}.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert preflight.read_cache(key) is None


def test_damaged_known_hosts_lines_never_stop_the_good_one(tmp_path):
    """Key data damaged in every way (truncated, flipped bytes, random, bad base64): each line is skipped."""
    import base64
    import random
    rng = random.Random(9)
    good = paramiko.ECDSAKey.generate()
    lines = []
    for _ in range(400):
        blob = bytearray(good.asbytes())
        mode = rng.randrange(3)
        if mode == 0:
            blob = blob[:rng.randrange(len(blob))]
        elif mode == 1:
            for _ in range(rng.randrange(1, 5)):
                blob[rng.randrange(len(blob))] = rng.randrange(256)
        else:
            blob = bytearray(rng.randrange(256) for _ in range(rng.randrange(100)))
        b64 = base64.b64encode(bytes(blob)).decode()[:rng.randrange(1, 200)] + rng.choice(["", "!", "="])
        lines.append(f"h1 {rng.choice(['ssh-rsa', 'ssh-ed25519', good.get_name()])} {b64}")
    kh = tmp_path / "kh"
    kh.write_text("\n".join(lines) + "\n" + keyscan.known_hosts_line("h1", good))
    target = sshtarget.SshTarget("h1", "h1", known_hosts=(str(kh),), global_known_hosts=())
    known_file, known = knownhosts.known_host_keys(target)
    knownhosts.verify_host_key(target, good, known_file, known)
