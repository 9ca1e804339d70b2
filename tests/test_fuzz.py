"""Generated bad input over every surface: always exit 2, one line on stderr, no traceback, quickly.

Each case takes a valid ``--dry-run`` command and spoils one input surface with a value
that no grammar admits (-H, hostfile text, every cluster-file field, -np, --mca, -x,
--mpi-args, --include/--exclude, interface options, SLURM_* variables, doctor and keyscan
timeouts, --ssh-config). The CLI runs in-process through ``launcher.cli.main``; a smaller
sample goes through the installed ``dtrun`` script.
"""
import io
import json
import os
import random
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout

import pytest

from dtrun.launcher.cli import main
from tests.dtrun_helpers import DTRUN, user_env

SEED = 14
PER_CASE_S = 10.0  # generous on a loaded 2-core machine; a hang or a DNS wait would blow far past it
# Characters that no host name, user, key or interface may hold (',', '.', ':' and '#' are syntax in some
# surfaces and are left out so that every generated value is invalid everywhere it is put).
HOSTILE_CHARS = list(" \n\t\r;$`'\"\\|&<>(){}*?!%/=@^~\x00\x1b") + ["\u00e9", "\u0663", "\u200b"]
BAD_COUNTS = ["0", "-1", "+4", "1_0", "\u0663", "1e3", "0x10", "2.0", " ", "", "4097", "1" + "0" * 30, "four",
              "3\n", "-0", "\uff14"]
BAD_NP = [c for c in BAD_COUNTS if c not in ("4097",)] + ["1048577"]
BAD_TIMEOUTS = ["nan", "inf", "-inf", "-1", "0", "0.0", "-5", "1e99", "NaN", "x"]
PAYLOADS = ["$(touch /tmp/pwned-hd-fuzz)", "`touch /tmp/pwned-hd-fuzz`", "a\nProxyCommand touch /tmp/pwned-hd-fuzz",
            '"\nProxyCommand touch /tmp/pwned-hd-fuzz\n"', "x;touch /tmp/pwned-hd-fuzz", "-oProxyCommand=touch"]


def spoil(rng, word="node1"):
    """``word`` with a hostile character inside it (never at the ends, which some parsers strip)."""
    i = rng.randrange(1, len(word))
    return word[:i] + rng.choice(HOSTILE_CHARS) + word[i:]


def bad_host(rng):
    return rng.choice([
        spoil(rng), spoil(rng, "node1.example.com"), rng.choice(PAYLOADS).replace("\n", "\\n") + "x",
        "999.1.1.1", "1.2.3.4.5", "256.0.0.1", "10", f"fe80::1%{spoil(rng, 'eth0')}", "fe80::1%",
        "-" + "node1", "node1-", "a" * 64, "a..b", ":::", "[fe80::1",
    ])


def bad_mca(rng):
    if rng.random() < 0.5:
        return [rng.choice(["1btl", "bad key", "btl-x", spoil(rng, "btl_tcp"), "a\nb"]), "x"]
    return ["btl_tcp_links", rng.choice(PAYLOADS + ["a;b", "a|b", "a'b", 'a"b', "a\\b", "a\nb", "$HOME"])]


def cases(tmp):
    """(label, argv, env) of invalid command lines; files they need are written under ``tmp``."""
    rng = random.Random(SEED)
    base = ["--dry-run", "-np", "2", "-H", "localhost:2"]
    out = []

    def add(label, argv, env=None):
        out.append((label, [str(a) for a in argv], env or {}))

    for _ in range(70):
        h = bad_host(rng)
        add("-H host", ["--dry-run", "-H", f"{h}:2" if rng.random() < 0.5 else h, "true"])
    for _ in range(30):
        add("-H slots", ["--dry-run", "-H", f"node1:{rng.choice(BAD_COUNTS)}", "true"])
    add("-H empty", ["--dry-run", "-H", "", "true"])
    add("--hostfile empty", ["--dry-run", "--hostfile", "", "true"])
    add("--cluster empty", ["--dry-run", "--cluster", "", "true"])
    for n in range(50):
        hf = tmp / f"hosts{n}"
        kind = n % 3
        if kind == 0:
            hf.write_text(f"node0 slots=1\n{spoil(rng).replace(chr(10), 'x').replace('#', 'x')} slots=2\n")
        elif kind == 1:
            hf.write_text(f"node0 slots=1\nnode1 slots={rng.choice(BAD_COUNTS).strip() or 'x'}\n")
        else:
            hf.write_text(f"node0\nnode1 {rng.choice(['colour=red', 'slots', 'slots=2 slots=3', 'max_slots=0'])}\n")
        add("hostfile text", ["--dry-run", "--hostfile", hf, "true"])
    fields = {"name": lambda: bad_host(rng), "user": lambda: spoil(rng, "ops"), "port": lambda: rng.choice(
        BAD_COUNTS + ["65536", "70000"]), "slots": lambda: rng.choice(BAD_COUNTS),
        "max_slots": lambda: rng.choice(BAD_COUNTS),
        "identity_file": lambda: rng.choice(["/k\n", '/k"\nProxyCommand touch /tmp/pwned-hd-fuzz', "/k/${HOME}",
                                             "/k/%h", "/k/*", "/k\\x"])}
    for n in range(90):
        field = list(fields)[n % len(fields)]
        value = fields[field]()
        where = rng.choice(["host", "defaults"]) if field != "name" else "host"
        entry = {"name": "node1", field: value} if where == "host" else {"name": "node1"}
        doc = {"hosts": [entry]}
        if where == "defaults":
            doc["defaults"] = {field: value}
        cf = tmp / f"cluster{n}.yaml"
        cf.write_text(json.dumps(doc))  # JSON is YAML: every value arrives exactly as generated
        add(f"cluster {where}.{field}", ["--dry-run", "--cluster", cf, "true"])
    for n, text in enumerate([
        "hosts: [a]\nhosts: [b]\n", "hosts:\n  - {name: a, slots: 1, slots: 2}\n", "hosts: " + "[" * 3000,
        "hosts: " + "[" * 3000 + "]" * 3000, "hosts: []\n", "hosts: a\n", "nodes: [a]\n", "{}", "- a\n",
        "hosts: [{name: a, colour: red}]\n", "defaults: {name: a}\nhosts: [b]\n", "ssh_config: \"/x\\n\"\nhosts: [a]\n",
        "\x00\x01", "hosts: [!!python/object:os.system {}]\n", "hosts:\n - &a [*a]\n",
    ]):
        cf = tmp / f"yaml{n}.yaml"
        cf.write_text(text)
        add("cluster yaml", ["--dry-run", "--cluster", cf, "true"])
    for _ in range(35):
        add("-np", ["--dry-run", "-np", rng.choice(BAD_NP), "-H", "localhost:2", "true"])
    for _ in range(50):
        add("--mca", base + ["--mca", *bad_mca(rng), "true"])
    add("--mca --", base + ["--mca", "btl", "--", "x", "true"])
    for _ in range(40):
        if rng.random() < 0.5:
            item = spoil(rng, "FOO").replace("=", "-") + "=1"
        else:
            item = "FOO=" + rng.choice(["a\nb", "a\rb", "\x1b[31m", "a\x00b".replace("\x00", "\x01")])
        add("-x", base + ["-x", item, "true"])
    for text in ['"', "'", '"a', "a'b", 'x "y', "\\", "a\x01b"] * 4:
        add("--mpi-args", base + ["--mpi-args", text, "true"])
    for _ in range(30):
        flag = rng.choice(["--include", "--exclude"])
        add(flag, ["--dry-run", "-H", "localhost:2", flag, rng.choice(["node9", bad_host(rng).replace(",", ";")]),
                   "true"])
    for _ in range(35):
        flag = rng.choice(["--include-iface", "--exclude-iface"])
        add(flag, base + [flag, rng.choice([spoil(rng, "eth0"), "10.0.0.0/99", "x" * 16, ",", "300.1.1.1/8"]), "true"])
    add("iface both", base + ["--include-iface", "eth0", "--exclude-iface", "lo", "true"])
    for _ in range(50):
        env = rng.choice([
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-100000]"},
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-1000]x[1-1000]"},
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "0(x2)"},
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x999999999)"},
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": rng.choice(["x", "1,", "(x2)", "4097(x2)", "3"])},
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": rng.choice(["n[1-", "n[a-b]", "n]1[", "999.1.1.1", spoil(rng, "node")])},
        ])
        add("SLURM_*", ["--dry-run", "true"], env)
    for _ in range(30):
        sub = rng.choice(["doctor", "keyscan"])
        flag = rng.choice(["--timeout", "--e2e-timeout"]) if sub == "doctor" else "--timeout"
        argv = [sub, "-H", "localhost", f"{flag}={rng.choice(BAD_TIMEOUTS)}"]
        add(f"{sub} {flag}", argv)
    for p in ["/nonexistent/ssh_config", "", str(tmp)]:
        add("--ssh-config", base + ["--ssh-config", p, "true"] if p else base + ["--ssh-config", "", "true"])
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    for special in [fifo, "/dev/zero", "/dev/urandom", tmp, "/nonexistent"]:
        add("special file", ["--dry-run", "--hostfile", special, "true"])
        add("special file", ["--dry-run", "--cluster", special, "true"])
    return out


def run_in_process(argv, env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    for k in env:
        monkeypatch.delenv(k)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - t0


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A cache of this test's own with the flavor already detected (as after any earlier dtrun run)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    for k in [k for k in os.environ if k.startswith("SLURM_") or k == "DTRUN_SSH_CONFIG"]:
        monkeypatch.delenv(k)
    from dtrun.launcher.flavors import detect_flavor, find_mpirun
    detect_flavor(find_mpirun())
    return cache


def snapshot(root):
    return sorted((str(p), p.stat().st_size) for p in root.rglob("*"))


def test_fuzz_every_surface_in_process(tmp_path, isolated_cache, monkeypatch):
    files = tmp_path / "inputs"
    files.mkdir()
    all_cases = cases(files)
    assert len(all_cases) >= 500
    before = snapshot(isolated_cache)
    failures = []
    for label, argv, env in all_cases:
        code, out, err, took = run_in_process(argv, env, monkeypatch)
        lines = err.strip().splitlines()
        ok = (code == 2 and len(lines) == 1 and lines[0].startswith("dtrun: error: ") and "Traceback" not in err
              and not out and took < PER_CASE_S)
        if not ok:
            failures.append(f"{label}: {argv!r} env={env} -> code {code} in {took:.1f} s, stderr {err[-300:]!r}")
    assert not failures, f"{len(failures)} of {len(all_cases)} cases:\n" + "\n".join(failures[:20])
    assert snapshot(isolated_cache) == before  # no bad input leaves a file behind
    assert not os.path.exists("/tmp/pwned-hd-fuzz")


def test_fuzz_sample_through_the_console_script(tmp_path, isolated_cache):
    files = tmp_path / "inputs"
    files.mkdir()
    sample = random.Random(SEED + 1).sample(cases(files), 25)
    for label, argv, env in sample:
        if any("\x00" in a for a in argv):
            continue  # an argv string cannot hold NUL; the in-process run covers it
        t0 = time.monotonic()
        p = subprocess.run([DTRUN, *argv], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                           env=user_env(XDG_CACHE_HOME=str(isolated_cache), **env))
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (label, argv, p.stderr)
        assert time.monotonic() - t0 < 30, (label, argv)
    assert not os.path.exists("/tmp/pwned-hd-fuzz")
