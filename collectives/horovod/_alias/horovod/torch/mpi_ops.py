"""``horovod.torch.mpi_ops`` under ``dtrun --horovod``: the collectives of
``dtrun.collectives.horovod.torch`` (``horovod.torch``) under Horovod's module name."""

from dtrun.collectives.horovod import torch as _adapter

globals().update({name: getattr(_adapter, name) for name in _adapter.__all__})
__all__ = list(_adapter.__all__)
