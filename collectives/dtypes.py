"""Mapping of array dtypes to MPI datatypes, MPI reduction ops and NumPy kernels.

Looked up once per dtype and cached in dictionaries keyed by ``numpy.dtype``, so the
per-call cost on the hot path is one dict lookup. float16 and bfloat16 have no
predefined MPI datatype in Open MPI or MPICH: they travel as 16-bit integers and are
reduced by user-defined MPI ops (and by the same NumPy kernels on the shared-memory
path), so every path gives the same bits.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from ._mpi import MPI

SUM = "sum"
PROD = "prod"
MIN = "min"
MAX = "max"
AVG = "avg"
#: Accepted spellings of reduction ops, mapped to the canonical name.
OP_ALIASES = {
    "sum": SUM, "add": SUM, "prod": PROD, "product": PROD, "mul": PROD,
    "min": MIN, "max": MAX, "avg": AVG, "average": AVG, "mean": AVG,
}
REDUCE_OPS = (SUM, PROD, MIN, MAX, AVG)

try:  # bfloat16 as a real NumPy dtype when ml_dtypes is installed (optional)
    import ml_dtypes  # type: ignore

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
    _BF16_NATIVE = True
except ImportError:  # a marker dtype: 16-bit storage, arithmetic done via float32
    BFLOAT16 = np.dtype([("bfloat16", "<u2")])
    _BF16_NATIVE = False

FLOAT16 = np.dtype(np.float16)

_MPI_TYPE: dict[np.dtype, MPI.Datatype] = {
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.uint64): MPI.UINT64_T,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
    np.dtype(np.bool_): MPI.C_BOOL,
    FLOAT16: MPI.INT16_T,
    BFLOAT16: MPI.INT16_T,
}

_PREDEFINED_OPS = {SUM: MPI.SUM, PROD: MPI.PROD, MIN: MPI.MIN, MAX: MPI.MAX, AVG: MPI.SUM}
_UFUNCS = {SUM: np.add, PROD: np.multiply, MIN: np.minimum, MAX: np.maximum, AVG: np.add}
_SOFT_FLOATS = (FLOAT16, BFLOAT16)  # reduced by our kernels, not by MPI's


def mpi_type(dtype: np.dtype) -> MPI.Datatype | None:
    """The MPI datatype that carries ``dtype`` (None if unsupported)."""
    return _MPI_TYPE.get(dtype)


def supported_dtypes() -> list[str]:
    return sorted({d.name if d is not BFLOAT16 else "bfloat16" for d in _MPI_TYPE})


def dtype_name(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == BFLOAT16 else dtype.name


def reduce_problem(dtype: np.dtype, op: str) -> str | None:
    """Why ``op`` cannot reduce ``dtype`` (None when it can)."""
    if dtype == np.bool_:
        return "bool arrays cannot be reduced with arithmetic ops; cast to uint8 first"
    if dtype.kind == "c" and op in (MIN, MAX):
        return f"complex numbers have no {op}"
    if op == AVG and dtype.kind not in "fc" and dtype not in _SOFT_FLOATS:
        return (f"average of {dtype_name(dtype)} would truncate; reduce with op='sum' "
                "and divide, or use a floating dtype")
    return None


# --- NumPy kernels: out = a (op) b, used by the shared-memory path and user MPI ops ---

def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f: np.ndarray, out_u16: np.ndarray) -> None:
    """Round float32 to bfloat16 bits, nearest-even (as PyTorch does); NaN stays NaN."""
    u = f.view(np.uint32)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = (u[nan] >> 16) | 0x40
    out_u16[...] = rounded.astype(np.uint16)


def kernel(dtype: np.dtype, op: str) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """Return ``f(a, b, out)`` computing ``out = a op b`` elementwise for ``dtype``."""
    ufunc = _UFUNCS[op]
    if dtype == BFLOAT16 and not _BF16_NATIVE:
        def bf16(a, b, out):
            a16, b16, o16 = a.view(np.uint16), b.view(np.uint16), out.view(np.uint16)
            _f32_to_bf16(ufunc(_bf16_to_f32(a16), _bf16_to_f32(b16)), o16)
        return bf16

    def native(a, b, out):
        ufunc(a, b, out=out)
    return native


_USER_OPS: dict[tuple[np.dtype, str], MPI.Op] = {}


def mpi_op(dtype: np.dtype, op: str) -> MPI.Op:
    """The MPI op that reduces ``dtype`` with ``op`` (AVG maps to SUM; divide after)."""
    if dtype not in _SOFT_FLOATS:
        return _PREDEFINED_OPS[op]
    key = (dtype, op)
    found = _USER_OPS.get(key)
    if found is None:
        k = kernel(dtype, op)
        storage = np.dtype(np.uint16) if (dtype == BFLOAT16 and not _BF16_NATIVE) else dtype

        def user_op(inbuf, inoutbuf, datatype, _k=k, _st=storage):
            a = np.frombuffer(inbuf, dtype=_st)
            b = np.frombuffer(inoutbuf, dtype=_st)
            # MPI defines inoutbuf = inbuf op inoutbuf; keep that operand order.
            _k(a, b, b)

        found = _USER_OPS[key] = MPI.Op.Create(user_op, commute=True)
    return found


def to_float64(a: np.ndarray) -> np.ndarray:
    """Values of ``a`` as float64 (for checks and printing; handles the bf16 marker)."""
    if a.dtype == BFLOAT16 and not _BF16_NATIVE:
        return _bf16_to_f32(a.view(np.uint16)).astype(np.float64)
    return a.astype(np.float64)


def from_float64(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Array of ``dtype`` holding ``values`` (exact for small integers)."""
    if dtype == BFLOAT16 and not _BF16_NATIVE:
        out = np.empty(values.shape, dtype=BFLOAT16)
        _f32_to_bf16(values.astype(np.float32), out.view(np.uint16))
        return out
    return values.astype(dtype)


def divider(dtype: np.dtype, n: int) -> Callable[[np.ndarray], None]:
    """In-place ``a /= n`` for a floating ``dtype`` (the last step of an average)."""
    if dtype == BFLOAT16 and not _BF16_NATIVE:
        def bf16(a):
            u = a.view(np.uint16)
            _f32_to_bf16(_bf16_to_f32(u) / np.float32(n), u)
        return bf16

    def native(a):
        np.true_divide(a, n, out=a, casting="unsafe")
    return native
