"""dtrun: a cluster launcher and preflight checker for MPI and deep-learning jobs.

Everything dtrun installs lives under this one name:

* ``dtrun.launcher`` — the ``dtrun`` command: launching, restarts, hangs, ``top``;
* ``dtrun.checks`` — ``dtrun doctor`` and the preflight;
* ``dtrun.collectives`` — the collectives runtime on every node (``dtrun.collectives.dp``,
  ``dtrun.collectives.horovod.torch`` / ``.tensorflow`` / ``.keras``).

In the source tree these subpackages are the folders ``launcher/``, ``checks/`` and
``collectives/`` at the top of the repository; pyproject.toml maps them here.

This file imports nothing: the ``dtrun`` command imports it before it can catch a signal
(launcher/entry.py), so it must take no time.
"""


def __getattr__(name: str):
    if name == "__version__":  # read from the installed metadata on first use
        from importlib import metadata

        try:
            return metadata.version("dtrun")
        except metadata.PackageNotFoundError:  # a source tree that was never installed
            return "0+unknown"
    raise AttributeError(f"module 'dtrun' has no attribute {name!r}")
