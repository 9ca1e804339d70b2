"""``dtrun --horovod``: an unchanged Horovod script's ``import horovod.torch`` loads
dtrun.collectives.horovod, in that job only.

The flag puts collectives/horovod/_alias first on the ranks' PYTHONPATH (the user's own
PYTHONPATH after it), forwarded like any -x variable by every flavor. Real jobs: 2 ranks here
with and without the flag, 2 namespace hosts, MPICH (Hydra); the commands of every flavor and
srun; and the alias package's module map itself, outside any job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from dtrun.launcher import command as cmd
from dtrun.launcher import slurm
from dtrun.launcher.flavors import MPICH, OPENMPI, Flavor
from dtrun.launcher.hosts import HostOptions, resolve_hosts
from dtrun.launcher.launch import HOROVOD_ALIAS, LaunchOptions, make_spec
from tests.dtrun_helpers import PYTHON, dtrun, one_line_error, user_env
from tests.horovod_common import results

ALIAS = HOROVOD_ALIAS
WHY = ("--horovod: dtrun's alias package first, so that `import horovod.torch` (.tensorflow, .keras) "
       "loads dtrun.collectives.horovod, in this job only")

# The unchanged Horovod script. USER_MODULE lives in a folder of the launching shell's
# PYTHONPATH (where a test puts one there): the ranks must still find it.
JOB = """
import importlib, json, os, socket, sys
import horovod
import horovod.torch as hvd
print("IMPORTED", os.environ["DTRUN_RANK"], horovod.__file__, flush=True)
import torch
from horovod.common.exceptions import HorovodInternalError

hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
adapter = importlib.import_module("dtrun.collectives.horovod.torch")
try:
    import horovod.mxnet
    mxnet = None
except ImportError as e:
    mxnet = f"{type(e).__name__}: {e}"
try:
    import alias_probe_user_module as mine
    mine = mine.__file__
except ImportError:
    mine = None
print("RESULT " + json.dumps({
    "rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(), "sum": total.tolist(),
    "adapter": hvd is adapter and sys.modules["horovod.torch"] is adapter,
    "internal_error": HorovodInternalError is adapter.HorovodInternalError,
    "version": horovod.__version__, "mxnet": mxnet, "mine": mine,
    "pythonpath": os.environ.get("PYTHONPATH")}), flush=True)
"""


def _job(tmp_path: Path) -> str:
    script = tmp_path / "train.py"
    script.write_text(JOB)
    return str(script)


def _imported(stdout: str) -> list[str]:
    """The horovod/__init__.py each rank imported (a rank's line may share another's)."""
    return re.findall(r"IMPORTED \d+ (\S+?__init__\.py)", stdout)


def _user_folder(tmp_path: Path) -> str:
    """A folder of the user's own PYTHONPATH, holding a module the job imports."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "alias_probe_user_module.py").write_text("")
    return str(mine)


def _check(found: list[dict], n: int, user_folder=None) -> None:
    for res in found:
        assert res["size"] == n and res["sum"] == [n * (n + 1) / 2]
        assert res["adapter"] is True and res["internal_error"] is True
        assert res["version"] == "0.28.1"
        assert res["mxnet"].startswith("ModuleNotFoundError: No module named 'horovod.mxnet': under "
                                       "dtrun --horovod, horovod is dtrun's Horovod adapter "
                                       "(dtrun.collectives.horovod), which provides "), res["mxnet"]
        assert "horovod.torch" in res["mxnet"] and "horovod.tensorflow" in res["mxnet"]
        if user_folder is None:
            assert res["pythonpath"] == ALIAS and res["mine"] is None
        else:  # ours first, then the user's, whose modules still import
            assert res["pythonpath"] == f"{ALIAS}:{user_folder}"
            assert res["mine"] == os.path.join(user_folder, "alias_probe_user_module.py")


# ----------------------------------------------------------------------------- real jobs
@pytest.mark.mpi
def test_the_flag_gives_the_adapter_to_that_job_only(tmp_path):
    script = _job(tmp_path)
    with_flag = dtrun("--horovod", "-np", 2, "-H", "localhost:2", "--oversubscribe", PYTHON, script,
                      timeout=180)
    _check(results(with_flag, 2), 2)
    imported = set(_imported(with_flag.stdout))
    assert imported == {os.path.join(ALIAS, "horovod", "__init__.py")}

    # The same script without the flag: the adapter is nowhere on the path (nothing was
    # installed as `horovod`); a Horovod installed in this environment is what it gets.
    without = dtrun("-np", 2, "-H", "localhost:2", "--oversubscribe", PYTHON, script, timeout=180)
    installed = subprocess.run([PYTHON, "-c", "import importlib.util as u; print(u.find_spec('horovod'))"],
                               capture_output=True, text=True, timeout=60, env=user_env(), cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    if installed.stdout.strip() == "None":
        assert without.returncode != 0, without.stdout
        assert "ModuleNotFoundError: No module named 'horovod'" in without.stderr, without.stderr[-3000:]
        assert "IMPORTED" not in without.stdout
    else:
        imported = _imported(without.stdout)
        assert imported and not any(p.startswith(ALIAS) for p in imported), without.stdout[-3000:]


@pytest.mark.mpi
def test_the_users_pythonpath_follows_the_adapters(tmp_path):
    mine = _user_folder(tmp_path)
    proc = dtrun("--horovod", "-np", 2, "-H", "localhost:2", "--oversubscribe", PYTHON, _job(tmp_path),
                 timeout=180, env=user_env(PYTHONPATH=mine))
    _check(results(proc, 2), 2, user_folder=mine)


@pytest.mark.cluster
@pytest.mark.mpi
def test_two_hosts_get_it_through_ssh(cluster3, tmp_path):
    # A remote rank's environment comes from sshd, not this shell: -x carries PYTHONPATH.
    mine = _user_folder(tmp_path)
    names = [h.name for h in cluster3.hosts[:2]]
    proc = dtrun("--horovod", "--ssh-config", cluster3.ssh_config, "-H", f"{names[0]}:1,{names[1]}:1",
                 PYTHON, _job(tmp_path), timeout=240, env=user_env(PYTHONPATH=mine))
    found = results(proc, 2)
    _check(found, 2, user_folder=mine)
    assert sorted(r["host"] for r in found) == sorted(names)


MPICH_RUN = "/usr/bin/mpiexec.mpich"
MPICH_LIB = Path("/usr/lib") / f"{os.uname().machine}-linux-gnu" / "libmpich.so.12"


@pytest.mark.flavor
@pytest.mark.mpi
def test_mpich_forwards_it_with_genv(tmp_path):
    missing = [p for p in (MPICH_RUN, MPICH_LIB) if not os.path.exists(p)]
    if missing:
        pytest.skip(f"{', '.join(map(str, missing))} not installed (CI installs mpich)")
    # mpi4py's MPICH build loads libmpi.so.12; Debian names MPICH's library libmpich.so.12
    libs = tmp_path / "mpich-lib"
    libs.mkdir()
    (libs / "libmpi.so.12").symlink_to(MPICH_LIB)
    mine = _user_folder(tmp_path)
    proc = dtrun("--horovod", "--mpirun", MPICH_RUN, "-x", f"MPI4PY_LIBMPI={libs / 'libmpi.so.12'}",
                 "-x", f"LD_LIBRARY_PATH={libs}", "-np", 2, "-H", "localhost:2", PYTHON, _job(tmp_path),
                 timeout=180, env=user_env(PYTHONPATH=mine))
    _check(results(proc, 2), 2, user_folder=mine)


# ----------------------------------------------------------------------------- the command
def _pythonpath_lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if "PYTHONPATH" in line]


def test_dry_run_shows_the_pythonpath_and_why(tmp_path):
    base = ("--dry-run", "-np", 2, "-H", "localhost:2", "python", "train.py")
    clean = {k: v for k, v in user_env().items() if k != "PYTHONPATH"}
    p = dtrun("--horovod", *base, env=clean)
    assert p.returncode == 0, p.stderr
    assert _pythonpath_lines(p.stdout) == [f"-x PYTHONPATH={ALIAS} # {WHY}"]

    p = dtrun("--horovod", *base, env=dict(clean, PYTHONPATH="/opt/mine:/opt/more"))
    assert _pythonpath_lines(p.stdout) == [
        f"-x PYTHONPATH={ALIAS}:/opt/mine:/opt/more # {WHY}; this shell's PYTHONPATH kept after it"]

    # -x PYTHONPATH=VALUE goes after ours, in the one PYTHONPATH the ranks get
    p = dtrun("--horovod", "-x", "PYTHONPATH=/x/y", *base, env=dict(clean, PYTHONPATH="/opt/mine"))
    assert _pythonpath_lines(p.stdout) == [
        f"-x PYTHONPATH={ALIAS}:/x/y # {WHY}; the value of -x PYTHONPATH kept after it"]

    p = dtrun(*base, env=dict(clean, PYTHONPATH="/opt/mine"))  # no flag: nothing added
    assert p.returncode == 0 and _pythonpath_lines(p.stdout) == []


def test_a_shell_pythonpath_with_a_newline_is_refused_before_anything_runs():
    # It would go on mpirun's command line after the alias folder: one line, exit 2.
    base = ("--horovod", "--dry-run", "-np", 2, "-H", "localhost:2", "python", "train.py")
    env = dict(user_env(), PYTHONPATH="/opt/mine\n-x EVIL=1")
    one_line_error(dtrun(*base, env=env), "--horovod: this shell's PYTHONPATH",
                   "contains a newline")
    # -x PYTHONPATH=VALUE replaces the shell's: then the shell's is never sent
    p = dtrun("-x", "PYTHONPATH=/x/y", *base, env=env)
    assert p.returncode == 0, p.stderr
    assert _pythonpath_lines(p.stdout) == [
        f"-x PYTHONPATH={ALIAS}:/x/y # {WHY}; the value of -x PYTHONPATH kept after it"]


OMPI5 = Flavor(OPENMPI, (5, 0, 11), "/venv/bin/mpirun", "/venv")
OMPI4 = Flavor(OPENMPI, (4, 1, 4), "/usr/bin/mpirun.openmpi", "/usr")
MPICH4 = Flavor(MPICH, (4, 0, 2), "/usr/bin/mpiexec.mpich", "/usr")
ALLOC = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}


def _spec(flavor: Flavor, environ: dict, horovod: bool = True):
    selection = resolve_hosts(HostOptions(host_list="n1:2,n2:2"), environ={}) if "SLURM_JOB_ID" not in environ \
        else resolve_hosts(environ=environ)
    return make_spec(LaunchOptions(program=("/bin/prog",), horovod=horovod, preflight=False), flavor,
                     selection, dict(environ, PATH="/usr/bin"))


@pytest.mark.parametrize("flavor,expected", [
    (OMPI5, ["-x", f"PYTHONPATH={ALIAS}:/opt/mine"]),
    (OMPI4, ["-x", f"PYTHONPATH={ALIAS}:/opt/mine"]),
    (MPICH4, ["-genv", "PYTHONPATH", f"{ALIAS}:/opt/mine"]),
])
def test_every_flavor_sets_it_on_remote_hosts(flavor, expected):
    groups = cmd.build_groups(_spec(flavor, {"PYTHONPATH": "/opt/mine"}), flavor)
    ours = [g for g in groups if any("PYTHONPATH" in a for a in g.args)]
    assert [list(g.args) for g in ours] == [expected]
    assert ours[0].why == f"{WHY}; this shell's PYTHONPATH kept after it"
    assert not any("PYTHONPATH" in a for g in cmd.build_groups(_spec(flavor, {}, horovod=False), flavor)
                   for a in g.args)


def test_srun_sets_it_in_the_steps_environment():
    spec = _spec(OMPI5, dict(ALLOC, PYTHONPATH="/opt/mine"))
    argv = [a for g in slurm.build_srun_groups(spec, OMPI5, ("pmix",)) for a in g.args]
    assert f"PYTHONPATH={ALIAS}:/opt/mine" in argv[:argv.index("--export=ALL")]


# ----------------------------------------------------------------------------- the alias package
# What Horovod's tests and examples import (test/parallel, test/utils, examples/pytorch,
# examples/tensorflow2). Each is dtrun's module of the same name, that very object, where
# dtrun has one; else one of the alias package's own shims.
TORCH_NAMES = ("horovod.torch", "horovod.torch.compression", "horovod.torch.sync_batch_norm",
               "horovod.torch.mpi_ops", "horovod.torch.elastic", "horovod.common.util", "horovod.common.exceptions",
               "horovod.runner.util.threads", "horovod.runner.common.util.env")
TF_NAMES = ("horovod.tensorflow", "horovod.tensorflow.keras", "horovod.keras", "horovod.keras.callbacks",
            "horovod.tensorflow.util", "horovod.tensorflow.mpi_ops", "horovod.tensorflow.elastic",
            "horovod.tensorflow.keras.elastic", "horovod.tensorflow.keras.callbacks", "horovod.keras.elastic")


def _dtruns(name: str):
    """dtrun's module for ``horovod.X`` (dtrun.collectives.horovod.X), or None where it has none."""
    import importlib.util

    real = "dtrun.collectives." + name
    try:
        return real if importlib.util.find_spec(real) is not None else None
    except ModuleNotFoundError:  # its parent is not dtrun's either (horovod.common.util)
        return None


PROBE = """
import importlib, json, sys
out = {}
for name, real in json.loads(sys.argv[1]).items():
    try:
        mod = importlib.import_module(name)
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
        continue
    if real is None:
        out[name] = mod.__file__
    else:
        out[name] = mod is importlib.import_module(real) and sys.modules[name] is sys.modules[real]
print(json.dumps(out))
"""


def _probe(names: dict, alias: bool = True) -> dict:
    env = {k: v for k, v in user_env().items() if k != "PYTHONPATH"}
    if alias:
        env["PYTHONPATH"] = ALIAS
    p = subprocess.run([PYTHON, "-c", PROBE, json.dumps(names)], capture_output=True, text=True, timeout=180,
                       env=env, cwd="/")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def _shim(name: str) -> str:
    rel = name.split(".")[1:]
    path = os.path.join(ALIAS, "horovod", *rel)
    return os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"


def _check_map(names: tuple) -> None:
    wanted = {n: _dtruns(n) for n in names}
    assert _probe(wanted) == {n: (True if real else _shim(n)) for n, real in wanted.items()}
    assert wanted["horovod.torch" if "horovod.torch" in wanted else "horovod.tensorflow"]


def test_alias_maps_horovods_torch_modules_to_dtrun():
    _check_map(TORCH_NAMES)


def test_alias_maps_horovods_tensorflow_modules_to_dtrun():
    _check_map(TF_NAMES)


def test_alias_refuses_what_dtrun_does_not_provide_and_is_on_no_path_by_itself():
    got = _probe({"horovod.mxnet": "x", "horovod.torch.nope": "x"})
    assert got["horovod.mxnet"].startswith("ModuleNotFoundError: No module named 'horovod.mxnet': under dtrun "
                                           "--horovod, horovod is dtrun's Horovod adapter (dtrun.collectives."
                                           "horovod), which provides horovod.common, ")
    assert got["horovod.mxnet"].endswith("(run without --horovod to use an installed Horovod)")
    assert "horovod.torch.mpi_ops" in got["horovod.torch.nope"]
    # Outside a --horovod job, `horovod` is not the alias package (nothing installed it).
    plain = _probe({"horovod": None}, alias=False)["horovod"]
    assert plain == "ModuleNotFoundError: No module named 'horovod'" or not plain.startswith(ALIAS), plain


def test_horovods_test_helpers_behave_as_horovods():
    code = """
import os, threading
from horovod.common.util import env, is_version_greater_equal_than
from horovod.runner.common.util.env import get_env_rank_and_size
from horovod.runner.util.threads import in_thread
os.environ.pop("ALIAS_A", None); os.environ["ALIAS_B"] = "old"
with env(ALIAS_A="1", ALIAS_B="new", ALIAS_C=None):
    inside = (os.environ["ALIAS_A"], os.environ["ALIAS_B"], "ALIAS_C" in os.environ)
print(inside, "ALIAS_A" in os.environ, os.environ["ALIAS_B"])
print(is_version_greater_equal_than("2.10.0", "2.4.0"), is_version_greater_equal_than("1.15", "2.0"))
os.environ.update(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2")
print(get_env_rank_and_size())
done = threading.Event()
t = in_thread(done.set)
t.join(30)
print(done.is_set(), t.daemon)
"""
    env = dict(user_env(), PYTHONPATH=ALIAS)
    for k in ("HOROVOD_RANK", "HOROVOD_SIZE"):
        env.pop(k, None)
    p = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["('1', 'new', False) False old", "True False", "(1, 2)", "True True"]
