"""``horovod.tensorflow.keras``'s spelling of ``collectives.horovod.keras``.

Horovod's is a package (``horovod.tensorflow.keras.callbacks``, ``.elastic``); so is this
module to the import system: its submodules are ``collectives.horovod.keras``'s, the very
module objects, under this name too.
"""

import sys

from .. import keras as _keras
from ..keras import *  # noqa: F401,F403
from ..keras import (DistributedOptimizer, PartialDistributedOptimizer,  # noqa: F401
                     __getattr__, broadcast_global_variables, callbacks, elastic, load_model)

# `import horovod.tensorflow.keras.elastic` finds the submodule in sys.modules under this
# name; dtrun --horovod's finder looks it up in __path__ first, and its file there resolves
# to the same registered object.
__path__ = list(_keras.__path__)
for _name, _module in list(sys.modules.items()):
    if _name.startswith(_keras.__name__ + "."):
        sys.modules[__name__ + _name[len(_keras.__name__):]] = _module
