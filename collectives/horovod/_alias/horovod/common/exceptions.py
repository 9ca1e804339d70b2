"""``horovod.common.exceptions`` under ``dtrun --horovod``: Horovod's exception names.

``HorovodInternalError`` is the adapter's own (what its collectives raise), so an
``except HorovodInternalError`` written for Horovod catches dtrun's errors.
"""

from dtrun.collectives import horovod as _adapter

HorovodInternalError = _adapter.HorovodInternalError

# Elastic Horovod's interrupt. dtrun restarts jobs instead (dtrun --max-restarts), so the
# adapter's own class is used where it has one and nothing raises this one otherwise.
HostsUpdatedInterrupt = getattr(_adapter, "HostsUpdatedInterrupt", None)
if HostsUpdatedInterrupt is None:
    class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 (Horovod's name)
        """The set of hosts changed (elastic Horovod); ``skip_sync`` as Horovod's."""

        def __init__(self, skip_sync: bool):
            super().__init__(skip_sync)
            self.skip_sync = skip_sync


class HorovodVersionMismatchError(ImportError):
    """A framework's version differs from the one Horovod was built with. The adapter is
    built against no framework, so nothing raises it: it exists for ``except`` clauses."""

    def __init__(self, name: str, version: str, installed_version: str):
        super().__init__(f"Framework {name} installed with version {installed_version} but found version {version}")
        self.name, self.version, self.installed_version = name, version, installed_version
