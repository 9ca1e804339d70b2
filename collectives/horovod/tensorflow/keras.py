"""``horovod.tensorflow.keras``'s spelling of ``collectives.horovod.keras``."""

from ..keras import *  # noqa: F401,F403
from ..keras import (DistributedOptimizer, PartialDistributedOptimizer,  # noqa: F401
                     __getattr__, broadcast_global_variables, callbacks, load_model)
