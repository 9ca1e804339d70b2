"""Argument names of the collectives that a device path calls directly.

Comm's methods take these positionally or by keyword; a path binds them to names once,
with the same defaults as Comm, instead of unpacking each call by hand.
"""

from __future__ import annotations

CORE_SIGNATURES = {
    "allreduce": ("x", "op", "out", "inplace"),
    "iallreduce": ("x", "op", "out", "inplace"),
    "reduce": ("x", "op", "root", "out", "inplace"),
    "broadcast": ("x", "root", "out", "inplace"),
    "scatter": ("x", "root", "out", "inplace"),
    "gather": ("x", "root", "out", "inplace"),
    "allgather": ("x", "out", "inplace"),
    "allgatherv": ("x", "out"),
    "gatherv": ("x", "root", "out"),
    "reduce_scatter": ("x", "op", "out", "inplace"),
    "alltoall": ("x", "out", "inplace"),
}
DEFAULTS = {"op": "sum", "root": 0, "out": None, "inplace": False}
P2P = ("send", "recv", "isend", "irecv", "sendrecv")


def bind(name: str, args: tuple, kwargs: dict) -> dict:
    """Every parameter of ``name`` (a collective in CORE_SIGNATURES) by name, defaults filled."""
    values = dict(DEFAULTS)
    values.update(zip(CORE_SIGNATURES.get(name, ("x", "op", "out", "inplace")), args))
    values.update(kwargs)
    return values
