"""Everything dtrun runs on another host: standard library only, so it works where the job's
environment is broken or absent.

What runs where:

* ``rankexec`` — the wrapper every rank runs under (mpirun/srun start
  ``python3 -S <repo>/launcher/remote/rankexec.py -- PROGRAM``): rank variables, markers, logs.
* ``agent`` — the host agent, started over ssh (or locally) as
  ``python3 -S <repo>/launcher/remote/agent.py dump|watch|sample|kill|tidy JOB_DIR``:
  stacks, progress watch, waiting samples (``waitsampler``), and killing a job's ranks.
* ``rankstate`` — the per-rank state files and faulthandler set-up the wrapper leaves for the agent.
* ``procfs`` — reading /proc: a process's start time, state, parent, and whether it is this job's.
* ``sessiondirs`` — Open MPI 5 session directories that killed jobs leave, and their removal.
* ``probe`` — the doctor's and preflight's probe; shipped to a host as one program
  (``bundle``), so it runs there even where no copy of dtrun is installed.
* ``wire`` — the rank wrapper's marker format, imported by the wrapper that writes the
  markers and the launcher that reads them.

Every module imports its siblings relatively (``from . import x``). A module started as a
script puts the folder that holds ``launcher/`` on ``sys.path[0]`` first (three lines at its
top) and imports this package; this file and ``launcher/__init__.py`` import only the
standard library, so that pulls in nothing else. The one import from outside this package
is ``dtrun.recorderfile``, the flight recorder's format that the runtime writes (it imports
nothing): see ``_expose_dtrun`` for how a script finds it. The probe's bundle ships none of
the modules that need it.
"""
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))


def _expose_dtrun(root):
    """Make ``import dtrun.recorderfile`` work in a script started from the folder ``root``
    that holds ``launcher/``. From a source tree ``root`` holds the ``dtrun/`` package too.
    Installed, ``root`` is the ``dtrun`` package itself (site-packages/dtrun), and
    site-packages is not on the path (``python -S``): ``root`` is named ``dtrun`` here,
    without running its ``__init__`` or putting site-packages on the path."""
    if "dtrun" not in sys.modules and os.path.isfile(os.path.join(root, "recorderfile.py")):
        package = types.ModuleType("dtrun")
        package.__path__ = [root]
        sys.modules["dtrun"] = package


if __name__ == "launcher.remote":  # imported by a script's bootstrap, not as dtrun.launcher.remote
    _expose_dtrun(os.path.dirname(os.path.dirname(_HERE)))

# Turns a dict of module sources into modules of this package, then runs the main program.
_LOADER = '''\
import sys, types
for _p in ("launcher", "launcher.remote"):
    sys.modules.setdefault(_p, types.ModuleType(_p)).__path__ = []
for _n, _s in _MODULES:
    _m = types.ModuleType("launcher.remote." + _n)
    _m.__package__ = "launcher.remote"
    sys.modules[_m.__name__] = _m
    setattr(sys.modules["launcher.remote"], _n, _m)
    exec(compile(_s, "launcher/remote/%s.py" % _n, "exec"), _m.__dict__)
del _p, _n, _s, _m
exec(compile(_MAIN, "launcher/remote/%s.py" % _MAIN_NAME, "exec"))
'''


def source(name):
    """The source text of this package's module ``name``."""
    with open(os.path.join(_HERE, name + ".py"), encoding="utf-8") as f:
        return f.read()


def bundle(main, modules=()):
    """One self-contained program (bytes) that runs module ``main`` as ``__main__`` after loading
    ``modules`` (dependencies first) as ``launcher.remote.<name>``: for ``python3 -c`` on a host
    that has no copy of this package."""
    head = "_MODULES = %r\n_MAIN_NAME = %r\n_MAIN = %r\n" % (
        tuple((m, source(m)) for m in modules), main, source(main))
    return (head + _LOADER).encode("utf-8")
