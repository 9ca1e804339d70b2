"""``horovod.tensorflow.keras``'s spelling of ``collectives.horovod.keras``."""

from ..keras import *  # noqa: F401,F403
from ..keras import DistributedOptimizer, broadcast_global_variables, callbacks  # noqa: F401
