"""The ssh settings dtrun hands to mpirun: a generated ssh config, and Hydra's ssh wrapper.

Open MPI takes ssh options as one string (``plm_ssh_args`` / ``plm_rsh_args``) that
ORTE and PRRTE split on spaces without any quoting, so the ``-F`` path in it must be
one plain word. dtrun therefore never puts a user's path there: it points ``-F`` at
a config it writes itself, in a directory whose path is plain (the cache directory,
or ``/tmp/dtrun-UID`` when ``$XDG_CACHE_HOME`` or ``$HOME`` holds a space), and that
config reaches the user's paths through quoted ``Include`` and ``IdentityFile``
lines. Hydra takes an ssh executable instead: a two-line script, shell-quoted.

Building the files is pure (``job_ssh_files``); ``GeneratedFile.write`` is the only
I/O, so ``--dry-run`` can show what a launch would write without writing it.
"""
from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dtrun.launcher import safe
from dtrun.launcher.errors import InvalidValue, LaunchError, UsageError
from dtrun.launcher.paths import atomic_write, cache_dir


@dataclass(frozen=True)
class GeneratedFile:
    """A file dtrun writes before a launch (content-addressed, so rewriting it is harmless)."""

    path: str
    text: str
    executable: bool = False

    def write(self) -> str:
        path = Path(self.path)
        private_dir(path.parent)
        if not path.exists() or path.read_text() != self.text:
            atomic_write(path, self.text, 0o700 if self.executable else 0o600)
        return self.path


@dataclass(frozen=True)
class SshFiles:
    """What mpirun gets: the ``-F`` config path, the Hydra wrapper, and the files to write first."""

    config: Optional[str] = None
    wrapper: Optional[str] = None
    files: tuple[GeneratedFile, ...] = ()

    def write(self) -> None:
        for f in self.files:
            f.write()


def base_ssh_config(given: Optional[str], from_cluster_file: Optional[str], environ) -> Optional[str]:
    """The user's ssh config: --ssh-config, else $DTRUN_SSH_CONFIG, else the cluster file's.

    The one precedence rule for the launch, doctor, keyscan and the preflight. None means
    none was named (ssh then reads ~/.ssh/config itself).

    Raises:
        UsageError: an empty --ssh-config, or the file named does not exist.
    """
    if given is not None and not given.strip():
        raise UsageError("--ssh-config: empty value")
    path = given or environ.get("DTRUN_SSH_CONFIG") or from_cluster_file
    if path and not os.path.isfile(path):
        raise UsageError(f"ssh config {path}: no such file")
    return path or None


def files_dir() -> Path:
    """Where generated ssh files go: a path that is one plain word, so Open MPI can take it."""
    base = cache_dir() / "ssh"
    try:
        safe.mca_word(str(base), "cache directory")
        return base
    except InvalidValue:
        return Path(f"/tmp/dtrun-{os.geteuid()}") / "ssh"


def private_dir(path: Path) -> None:
    """Create ``path`` (0700) and make sure only this user can write to it.

    Raises:
        LaunchError: it is a symlink, someone else's, or writable by others.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.mkdir(exist_ok=True, mode=0o700)
        for p in (path.parent, path) if str(path.parent).startswith("/tmp/dtrun-") else (path,):
            st = os.lstat(p)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise LaunchError(f"{p} is not a directory owned by this user; remove it and retry")
            if st.st_mode & 0o022:
                os.chmod(p, 0o700)
    except OSError as exc:
        raise LaunchError(f"cannot create {path}: {exc.strerror}") from None


def _named(kind: str, text: str, executable: bool = False) -> GeneratedFile:
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return GeneratedFile(str(files_dir() / f"{kind}-{digest}"), text, executable)


def config_text(hosts, base_config: Optional[str], source: str, home_config: Optional[str] = None) -> str:
    """The ssh config for ``hosts``: a Host block per host with settings, then ``Include`` of the base.

    Every value passes through ``launcher.safe``: host names and users are plain words,
    paths are double-quoted and may hold nothing OpenSSH would expand or parse.
    """
    home_config = os.path.expanduser("~/.ssh/config") if home_config is None else home_config
    lines = ["# written by dtrun from " + " ".join(source.split())[:200].replace("\n", " ")]
    for h in hosts:
        if not h.has_ssh_settings:
            continue
        lines.append(f"Host {safe.ssh_config_word(safe.host_name(h.host), 'host name')}")
        if h.user:
            lines.append(f"  User {safe.ssh_config_word(safe.user_name(h.user), 'user')}")
        if h.port:
            lines.append(f"  Port {safe.port(h.port)}")
        if h.identity_file:
            lines.append(f"  IdentityFile {safe.ssh_config_path(os.path.abspath(h.identity_file), 'identity_file')}")
    include = base_config or home_config
    if base_config or os.path.exists(include):
        lines += ["Host *", f"  Include {safe.ssh_config_path(os.path.abspath(include), 'ssh config')}"]
    return "\n".join(lines) + "\n"


def job_ssh_files(selection, base_config: Optional[str], openmpi: bool) -> SshFiles:
    """The ssh config (and for Hydra the wrapper) a launch needs; nothing is written here.

    Without per-host settings and with no base config, mpirun uses plain ssh (None).
    A base config whose path is a plain word is passed as it is.
    """
    per_host = any(h.has_ssh_settings for h in selection.hosts)
    if not per_host and not base_config:
        return SshFiles()
    files: list[GeneratedFile] = []
    if not per_host and _plain(os.path.abspath(base_config)):
        config = os.path.abspath(base_config)
    else:
        gen = _named("config", config_text(selection.hosts, base_config, selection.source))
        files.append(gen)
        config = gen.path
    wrapper = None
    if not openmpi:
        script = _named("ssh", f"#!/bin/sh\nexec ssh -F {safe.shell_word(config)} \"$@\"\n", executable=True)
        files.append(script)
        wrapper = script.path
    return SshFiles(config, wrapper, tuple(files))


def _plain(path: str) -> bool:
    try:
        safe.mca_word(path, "path")
        return True
    except InvalidValue:
        return False


def write_job_config(selection, base_config: Optional[str]) -> Optional[str]:
    """Write the config ``job_ssh_files`` describes and return its path (doctor's end-to-end job)."""
    files = job_ssh_files(selection, base_config, openmpi=True)
    files.write()
    return files.config
