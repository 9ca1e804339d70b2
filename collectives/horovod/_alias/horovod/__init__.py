"""``horovod`` inside a ``dtrun --horovod`` job: Horovod's module names on dtrun's adapter.

``dtrun --horovod`` puts the folder above this package first on the ranks' PYTHONPATH, so an
unchanged script's ``import horovod.torch as hvd`` (or a library's) gets
``dtrun.collectives.horovod.torch`` itself, and likewise ``horovod.tensorflow``,
``horovod.tensorflow.keras`` and ``horovod.keras`` (``_finder.py`` says how). Outside such a
job that folder is on no path: ``import horovod`` finds an installed Horovod, or nothing.
"""

import importlib as _importlib
import sys as _sys

try:
    _importlib.import_module("dtrun.collectives.horovod")
except ImportError as exc:
    raise ImportError(
        f"horovod: dtrun --horovod runs Horovod scripts on dtrun.collectives.horovod, which this "
        f"Python ({_sys.executable}) cannot import ({exc}); run the job with the Python that "
        "dtrun is installed in") from None

from ._finder import install as _install

# The Horovod release whose API the adapter follows (what scripts compare against).
__version__ = "0.28.1"

_install()


def __getattr__(name: str):
    if name == "run":
        raise AttributeError("horovod.run (Horovod's launcher API) is not provided under dtrun --horovod: "
                             "dtrun has started this job already")
    raise AttributeError(f"module 'horovod' has no attribute {name!r}")
