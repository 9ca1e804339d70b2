"""Horovod's ``hvd.load_model``: ``tf.keras.models.load_model`` with the saved optimizer
rebuilt as a ``DistributedOptimizer``, for Keras 3 and tf_keras alike."""

from __future__ import annotations

import tensorflow as tf


def _stand_in(base, make):
    """A class of ``base``'s name whose ``from_config`` (what both Kerases call to rebuild
    a saved optimizer) returns ``make(base.from_config(config))``."""
    def from_config(cls, config, custom_objects=None):
        return make(base.from_config(config))
    return type(base.__name__, (base,), {"__module__": base.__module__,
                                         "from_config": classmethod(from_config)})


def _optimizer_classes(keras, legacy_opts: bool) -> list:
    root = keras.optimizers.legacy.Optimizer if legacy_opts else keras.optimizers.Optimizer
    return list(root.__subclasses__())


def load_model(distributed, filepath, custom_optimizers, custom_objects, compression,
               legacy_opts):
    """``distributed``: ``DistributedOptimizer``; the rest as Horovod's ``load_model``."""
    keras = tf.keras

    def make(opt):
        return distributed(opt, compression=compression)
    objects = {}
    for cls in _optimizer_classes(keras, legacy_opts):
        objects[cls.__name__] = objects[cls.__name__.lower()] = _stand_in(cls, make)
    for cls in custom_optimizers or ():
        objects[cls.__name__] = _stand_in(cls, make)
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)
