"""dtrun.collectives.dp's checkpoints against a hostile shared directory, damaged files and states
that fail: real processes (alone, or two ranks under dtrun) running tests/checkpoint_cases.py.

The attack test needs root and a second uid (created as ``dtother``, uid 4242, when missing).
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.dtrun_helpers import OTHER_UID, REPO, dtrun, result_records, user_env

torch = pytest.importorskip("torch", reason="PyTorch is not installed (collectives.dp needs it)")
PYTHON = sys.executable
CASES = str(REPO / "tests" / "checkpoint_cases.py")


def results(out: str) -> list[dict]:
    found = result_records(out)
    return sorted(found, key=lambda r: r.get("rank", 0))


def alone(*args, timeout: float = 60) -> dict:
    """Run one case in a process of its own (one rank, no launcher); its one result."""
    p = subprocess.run([PYTHON, CASES, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO, env=user_env(), stdin=subprocess.DEVNULL)
    found = results(p.stdout)
    assert len(found) == 1, p.stdout[-2000:] + p.stderr[-2000:]
    return found[0]


def two_ranks(*args, timeout: float = 90) -> list[dict]:
    """Run one case on two ranks under dtrun; every rank must report and the job must end."""
    p = dtrun("-np", 2, "-H", "localhost:2", "--oversubscribe", PYTHON, CASES, *args, timeout=timeout)
    found = results(p.stdout)
    assert [r["rank"] for r in found] == [0, 1], p.stdout[-3000:] + p.stderr[-3000:]
    return found


def same_error_everywhere(found: list[dict], *needles: str) -> str:
    errors = {r.get("error") for r in found}
    assert len(errors) == 1 and None not in errors, found
    assert all(r["type"] == "CheckpointError" and r["oserror"] for r in found), found
    error = errors.pop()
    for needle in needles:
        assert needle in error, (needle, error)
    return error


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class RunsCommand:
    """Unpickling it (weights_only=False) runs ``touch MARKER``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------- a hostile shared directory
@pytest.fixture
def shared_dir():
    d = Path(tempfile.mkdtemp(prefix="dtrun-ckpt-shared-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _plant_links(other_user, shared: Path, victim: Path, pid: int) -> None:
    """The other user points every name a save might use at ``victim``."""
    from dtrun.collectives.checkpoint import _host_tag

    script = ("import os, sys\nd, victim, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
              "for i in range(2, 32768):\n    os.symlink(victim, f'{d}/ckpt.pt.tmp.{i}')\n"
              "for i in range(16):\n    os.symlink(victim, f'{d}/.ckpt.pt.dtrun-tmp-{sys.argv[4]}-{pid}-{i:016x}')\n")
    p = other_user("/usr/bin/python3", "-c", script, str(shared), str(victim), str(pid), _host_tag())
    assert p.returncode == 0, p.stderr


def test_a_second_user_in_a_shared_directory_cannot_redirect_the_save_or_run_code_at_load(
        tmp_path, other_user, shared_dir):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o600)
    marker = tmp_path / "MARKER"
    ckpt = shared_dir / "ckpt.pt"
    saver = subprocess.Popen([PYTHON, CASES, "save-on-go", str(ckpt)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=user_env())
    try:
        assert saver.stdout.readline().strip() == "ready", saver.stderr.read()
        _plant_links(other_user, shared_dir, victim, saver.pid)
        out, err = saver.communicate("go\n", timeout=60)
    finally:
        if saver.poll() is None:
            saver.kill()
    assert results(out) == [{"rank": 0, "saved": True}], out + err
    assert victim.read_text() == "precious" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    st = os.lstat(ckpt)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    # The other user swaps in a pickle that runs a command: as ckpt.pt, beside it, behind a link.
    evil = shared_dir / "evil.src"
    evil.write_bytes(torch_bytes({"step": 666, "x": RunsCommand(marker)}))
    evil.chmod(0o644)
    other_user("/bin/sh", "-c", f"cd {shared_dir} && cp evil.src theirs.pt && ln -s theirs.pt link.pt && "
                                "(mv -f theirs.pt ckpt.pt || rm -f ckpt.pt || true)")
    assert alone("load", ckpt)["state"] == {"step": 7, "w": 64.0}
    refused = alone("load", shared_dir / "theirs.pt", "trusted")["error"]
    assert f"owned by uid {OTHER_UID}" in refused and "another user" in refused
    assert "symbolic link" in alone("load", shared_dir / "link.pt", "trusted")["error"]
    mine = tmp_path / "copied.pt"  # the same bytes in a file of root's own: weights_only refuses them
    shutil.copyfile(evil, mine)
    error = alone("load", mine)["error"]
    assert "weights_only" in error and "trusted=True" in error and "runs any code" in error
    assert not marker.exists()


# ---------------------------------------------------------------- every rank sees rank 0's failure
@pytest.mark.mpi
def test_a_fifo_as_the_path_fails_on_every_rank_instead_of_blocking(tmp_path):
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    same_error_everywhere(two_ranks("load", fifo, timeout=60), str(fifo), "not a regular file")


@pytest.mark.mpi
@pytest.mark.parametrize("trusted", [False, True])
def test_a_load_that_fails_on_rank_0_raises_the_same_error_on_every_rank(tmp_path, trusted):
    import types

    module = types.ModuleType("dtrun_no_such_module")
    Gone = type("Gone", (), {"__module__": "dtrun_no_such_module"})  # noqa: N806
    module.Gone = Gone
    sys.modules["dtrun_no_such_module"] = module
    try:
        payload = torch_bytes({"step": 1, "x": Gone()})
    finally:
        del sys.modules["dtrun_no_such_module"]
    path = tmp_path / "ckpt.pt"
    path.write_bytes(payload)  # torch.save's own format: no checksum header
    found = two_ranks("load", path, "trusted" if trusted else "")
    if trusted:
        same_error_everywhere(found, "load_checkpoint on rank 0", str(path), "ModuleNotFoundError",
                              "dtrun_no_such_module")
    else:
        same_error_everywhere(found, "load_checkpoint on rank 0", str(path), "dtrun_no_such_module",
                              "trusted=True")


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["lambda", "reduce"])
def test_a_save_that_fails_on_rank_0_raises_the_same_error_on_every_rank(tmp_path, kind):
    path = tmp_path / "ckpt.pt"
    found = two_ranks("save-bad", path, kind)
    needle = "Can't pickle" if kind == "lambda" else "refuses to be pickled"
    same_error_everywhere(found, "save_checkpoint on rank 0", str(path), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary file left


# ---------------------------------------------------------------- damage and leftovers
@pytest.mark.mpi
def test_a_flipped_byte_in_tensor_data_is_refused_on_every_rank(tmp_path):
    path = tmp_path / "ckpt.pt"
    assert alone("save", path) == {"rank": 0, "saved": True}
    data = bytearray(path.read_bytes())
    at = data.find(bytes(torch.ones(64).numpy().tobytes()))
    assert at > 0
    data[at + 5] ^= 0x01  # one float of w changes; the zip archive stays readable
    path.write_bytes(bytes(data))
    same_error_everywhere(two_ranks("load", path), str(path), "checksum mismatch")


def test_a_file_torch_save_wrote_directly_still_loads(tmp_path):
    path = tmp_path / "plain.pt"
    path.write_bytes(torch_bytes({"step": 3, "w": torch.ones(4)}))
    assert alone("load", path)["state"] == {"step": 3, "w": 4.0}


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    from dtrun.collectives.checkpoint import _host_tag

    path = tmp_path / "ckpt.pt"
    p = subprocess.run([PYTHON, CASES, "save-killed", str(path)], capture_output=True, text=True,
                       timeout=60, cwd=REPO, env=user_env(), stdin=subprocess.DEVNULL)
    assert p.returncode == -9, p.stderr
    left = [q.name for q in tmp_path.iterdir()]
    assert len(left) == 1 and left[0] != "ckpt.pt", left  # the killed save's temporary file
    prefix = f".ckpt.pt.dtrun-tmp-{_host_tag()}"
    live = tmp_path / f"{prefix}-{os.getpid()}-00"  # a writer still running: kept
    live.write_bytes(b"x")
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / f"{prefix}-99999-01").symlink_to(target)  # a link (its writer gone): never removed
    old = tmp_path / ".ckpt.pt.dtrun-tmp-0000beef-1-02"  # another host's, untouched for two days
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    assert alone("save", path) == {"rank": 0, "saved": True}
    assert sorted(q.name for q in tmp_path.iterdir()) == sorted(
        ["ckpt.pt", live.name, "target", f"{prefix}-99999-01"])
    assert target.read_bytes() == b"keep"
