"""dtrun.launcher.paths: the cache directory and the one atomic writer every cache uses."""
from __future__ import annotations

import os
import stat

from dtrun.launcher.paths import atomic_write, cache_dir


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "dtrun"


def test_atomic_write_replaces_whole_file_and_leaves_nothing_behind(tmp_path):
    target = tmp_path / "new" / "cache.json"
    atomic_write(target, "first")
    atomic_write(target, "second")
    assert target.read_text() == "second"
    assert sorted(os.listdir(target.parent)) == ["cache.json"]  # no temporary file left
    assert stat.S_IMODE(os.stat(target.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


def test_atomic_write_mode_for_scripts(tmp_path):
    script = tmp_path / "ssh-wrapper"
    atomic_write(script, "#!/bin/sh\n", mode=0o755)
    assert stat.S_IMODE(os.stat(script).st_mode) == 0o755


def test_atomic_write_does_not_follow_a_planted_symlink(tmp_path):
    target = tmp_path / "cache.json"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / f".cache.json.{os.getpid()}.tmp")
    try:
        atomic_write(target, "new")
    except OSError:
        pass  # refusing is fine; writing through the link is not
    assert victim.read_text() == "keep"
