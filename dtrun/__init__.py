"""dtrun: a cluster launcher and preflight checker for MPI and deep-learning jobs.

Everything dtrun installs lives under this one name:

* ``dtrun.launcher`` — the ``dtrun`` command: launching, restarts, hangs, ``top``;
* ``dtrun.checks`` — ``dtrun doctor`` and the preflight;
* ``dtrun.collectives`` — the collectives runtime on every node (``dtrun.collectives.dp``,
  ``dtrun.collectives.horovod.torch`` / ``.tensorflow`` / ``.keras``).

In the source tree these subpackages are the folders ``launcher/``, ``checks/`` and
``collectives/`` at the top of the repository; pyproject.toml maps them here.
"""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("dtrun")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
