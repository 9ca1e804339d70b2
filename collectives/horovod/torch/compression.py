"""Horovod's ``Compression.none`` / ``Compression.fp16`` for PyTorch tensors."""

from __future__ import annotations

import torch

from ... import dp
from ..compression import FP16Compressor as _FP16Base
from ..compression import NoneCompressor


class FP16Compressor(_FP16Base):
    """float32/float64 travel as float16 (half the bytes) and come back in their dtype."""

    float16 = torch.float16
    is_float = staticmethod(lambda dtype: dtype.is_floating_point)
    cast = staticmethod(lambda tensor, dtype: tensor.to(dtype))


class Compression:
    """``Compression.none`` and ``Compression.fp16``, as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor

    @staticmethod
    def to_dp(compression) -> str:
        """dtrun.collectives.dp's name for a Horovod compressor."""
        if compression in (NoneCompressor, None) or isinstance(compression, NoneCompressor):
            return dp.Compression.none
        if compression is FP16Compressor or isinstance(compression, FP16Compressor):
            return dp.Compression.fp16
        raise ValueError(f"compression={compression!r}: DistributedOptimizer takes "
                         "Compression.none or Compression.fp16")
