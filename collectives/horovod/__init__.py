"""Horovod's API on dtrun's collectives runtime.

A Horovod script changes one import and nothing else (or none: ``dtrun --horovod`` makes
``import horovod.torch`` and the rest resolve to these modules for that job)::

    import dtrun.collectives.horovod.torch as hvd          # was: import horovod.torch as hvd
    import dtrun.collectives.horovod.tensorflow as hvd     # was: import horovod.tensorflow as hvd
    import dtrun.collectives.horovod.keras as hvd          # was: import horovod.tensorflow.keras as hvd

Each of those modules imports only its own framework (TensorFlow users never import
torch, and the reverse). Nothing is compiled against a framework: the collectives are
``collectives.Comm``'s, matched by name in the background as Horovod's (``_engine.py``),
and PyTorch's ``DistributedOptimizer`` is ``collectives.dp``'s. Elastic training
(``hvd.elastic``) runs on dtrun's restarts: commits on each host's disk, a new attempt
when hosts are lost or added (``_elastic.py``).

Importing this package imports neither a framework nor MPI.
"""

from __future__ import annotations

from ._core import HorovodUnsupportedError
from ._engine import DuplicateNameError, HorovodInternalError, HorovodMismatchError, HostsUpdatedInterrupt

__all__ = ["DuplicateNameError", "HorovodInternalError", "HorovodMismatchError",
           "HorovodUnsupportedError", "HostsUpdatedInterrupt"]
