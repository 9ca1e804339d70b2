"""dtrun as users install it: the wheel and the sdist that ``python -m build`` makes, each
installed into a fresh virtual environment, and ``pipx install .``.

Installs run with no network: dtrun's dependencies and PyPI's own ``checks``, ``collectives``
and ``launcher`` distributions come from the wheelhouse ``make test`` fills (.venv/wheelhouse).
Each environment then runs what a new user runs first: ``dtrun --version``, ``dtrun --dry-run``
and a 2-rank job with the runtime.
"""
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.dtrun_helpers import BIN, REPO

pytestmark = pytest.mark.mpi

WHEELHOUSE = BIN.parent / "wheelhouse"
NEIGHBOURS = WHEELHOUSE / "neighbours"
# A 2-rank job: dtrun's runtime sums across ranks, beside PyPI's `Checks` (imported) and
# `collectives` (found: importing it raises "coming soon", its whole content).
JOB = ("import importlib.util, numpy as np, Checks\n"
       "from dtrun import collectives\n"
       "theirs = importlib.util.find_spec('collectives').origin\n"
       "c = collectives.init()\n"
       "print('sum', c.rank, c.allreduce(np.full(3, c.rank + 1.0)).tolist(), theirs, flush=True)\n")


def _run(argv, timeout=600, **kw):
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, argv))}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def _offline_env(**extra):
    """pip with no index: everything from the wheelhouse."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=f"{WHEELHOUSE} {NEIGHBOURS}", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.update(extra)
    return env


def _fresh_venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", path])
    return path / "bin"


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """The sdist and the wheel, as `python -m build` makes them (the wheel from the sdist)."""
    assert WHEELHOUSE.is_dir() and NEIGHBOURS.is_dir(), "the wheelhouse is missing: run `make setup`"
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, REPO], cwd=out)
    sdist = next(out.glob("dtrun-*.tar.gz"))
    wheel = next(out.glob("dtrun-*.whl"))
    return sdist, wheel


def _hashes(site: Path, dist_info: Path) -> dict:
    """sha256 of every file a distribution's RECORD lists."""
    files = {}
    for line in (dist_info / "RECORD").read_text().splitlines():
        name = line.split(",")[0]
        if name and not name.endswith(".pyc") and (site / name).is_file():
            files[name] = hashlib.sha256((site / name).read_bytes()).hexdigest()
    return files


def _two_rank_job(bin_dir: Path, cwd: Path, env=None):
    script = cwd / "job.py"
    script.write_text(JOB)
    return _run([bin_dir / "dtrun", "-np", "2", "--oversubscribe", bin_dir / "python", script], cwd=cwd,
                env=env or _offline_env(PATH=f"{bin_dir}:/usr/bin:/bin"), timeout=180)


def test_the_wheel_installs_only_dtrun_beside_pypis_checks_collectives_and_launcher(dists, tmp_path):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        tops = {line.split(",")[0].split("/")[0] for line in z.read(record).decode().splitlines() if line}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"dtrun"}, tops

    bin_dir = _fresh_venv(tmp_path / "venv")
    env = _offline_env(PATH=f"{bin_dir}:/usr/bin:/bin")
    _run([bin_dir / "pip", "install", "checks", "collectives", "launcher"], env=env, cwd=tmp_path)
    site = Path(_run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=tmp_path).stdout.strip())
    theirs = {d.name: _hashes(site, d) for d in site.glob("*.dist-info")
              if d.name.lower().startswith(("checks-", "collectives-", "launcher-"))}
    assert len(theirs) == 3, sorted(theirs)
    _run([bin_dir / "pip", "install", wheel], env=env, cwd=tmp_path)
    assert {name: _hashes(site, site / name) for name in theirs} == theirs, "dtrun changed another package's files"

    version = _run([bin_dir / "dtrun", "--version"], env=env, cwd=tmp_path).stdout.splitlines()
    assert version[0] == "dtrun 0.1.0" and version[1].startswith(f"MPI: Open MPI 5.") and \
        version[2] == f"installed at: {site / 'dtrun'}", version
    dry = _run([bin_dir / "dtrun", "-np", "2", "--dry-run", "python", "train.py"], env=env, cwd=tmp_path).stdout
    assert f"{site}/dtrun/launcher/remote/rankexec.py" in dry, dry
    out = _two_rank_job(bin_dir, tmp_path, env).stdout
    sums = sorted(line.split(None, 2)[1:] for line in out.splitlines() if line.startswith("sum "))
    assert [s[0] for s in sums] == ["0", "1"] and all(s[1].startswith("[3.0, 3.0, 3.0] ") for s in sums), out
    assert all(f"{site}/collectives/__init__.py" in s[1] for s in sums), out  # PyPI's, not ours


def test_the_sdist_installs_without_a_c_compiler_and_says_why_it_is_slower(dists, tmp_path):
    sdist, _ = dists
    bin_dir = _fresh_venv(tmp_path / "venv")
    env = _offline_env(PATH=f"{bin_dir}:/usr/bin:/bin", CC="false", CXX="false")
    _run([bin_dir / "pip", "install", sdist, "checks", "collectives"], env=env, cwd=tmp_path)
    assert _run([bin_dir / "python", "-c", "import dtrun.collectives.shm1 as s; print(s._fastshm)"],
                env=env, cwd=tmp_path).stdout.strip() == "None"
    job = _two_rank_job(bin_dir, tmp_path, env)
    said = [line for line in job.stderr.splitlines() if "_fastshm" in line]
    assert said == ["dtrun.collectives: dtrun.collectives._fastshm is not built (no C compiler or Python headers "
                    "at install): collectives take the Python and MPI paths"], job.stderr
    assert sorted(line.split()[1] for line in job.stdout.splitlines() if line.startswith("sum ")) == ["0", "1"]


def test_pipx_install_gives_a_working_dtrun(tmp_path):
    home, bins = tmp_path / "pipx", tmp_path / "bin"
    env = _offline_env(PIPX_HOME=str(home), PIPX_BIN_DIR=str(bins), PIPX_MAN_DIR=str(tmp_path / "man"),
                       PATH=f"{bins}:/usr/bin:/bin")
    _run([sys.executable, "-m", "pipx", "install", REPO], env=env, cwd=tmp_path)
    version = _run([bins / "dtrun", "--version"], env=env, cwd=tmp_path).stdout.splitlines()
    assert version[0] == "dtrun 0.1.0" and version[2].startswith(f"installed at: {home}/venvs/dtrun/"), version
