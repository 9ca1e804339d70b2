"""``horovod.tensorflow.elastic`` is not provided: importing it says what to use instead."""

from .._core import unsupported

raise unsupported("elastic")
