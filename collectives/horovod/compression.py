"""Horovod's ``Compression.none`` and ``Compression.fp16``, written once for every
framework: ``fp16`` sends float32/float64 tensors as float16 (half the bytes) and casts
them back. Each framework's module subclasses ``FP16Compressor`` with its own dtype test
and cast; this module imports no framework.
"""

from __future__ import annotations

from typing import Any, Callable


class NoneCompressor:
    """Tensors travel as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """float32/float64 travel as float16 (half the bytes) and come back in their dtype."""

    # Set by each framework's subclass:
    float16: Any = None                        # its float16 dtype
    is_float: Callable[[Any], bool] = None     # whether a dtype is floating point
    cast: Callable[[Any, Any], Any] = None     # (tensor, dtype) -> tensor in that dtype

    @classmethod
    def compress(cls, tensor):
        if cls.is_float(tensor.dtype) and tensor.dtype != cls.float16:
            return cls.cast(tensor, cls.float16), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return cls.cast(tensor, ctx) if ctx is not None else tensor
