"""``horovod.common.exceptions`` under ``dtrun --horovod``: Horovod's exception names.

``HorovodInternalError`` is the adapter's own (what its collectives raise), so an
``except HorovodInternalError`` written for Horovod catches dtrun's errors.
"""

from dtrun.collectives import horovod as _adapter

HorovodInternalError = _adapter.HorovodInternalError

# Elastic Horovod's interrupt: raised on every rank at the commit after dtrun found hosts to
# add or remove (collectives/horovod/_elastic.py).
HostsUpdatedInterrupt = _adapter.HostsUpdatedInterrupt


class HorovodVersionMismatchError(ImportError):
    """A framework's version differs from the one Horovod was built with. The adapter is
    built against no framework, so nothing raises it: it exists for ``except`` clauses."""

    def __init__(self, name: str, version: str, installed_version: str):
        super().__init__(f"Framework {name} installed with version {installed_version} but found version {version}")
        self.name, self.version, self.installed_version = name, version, installed_version
