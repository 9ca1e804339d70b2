"""``horovod.common.util`` under ``dtrun --horovod``: the helpers Horovod's tests and
examples import (``env``, ``is_version_greater_equal_than``, the ``*_built`` queries)."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def env(**kwargs):
    """Set environment variables (those given None are left alone) for the ``with`` block,
    then restore each to its old value, or remove it where it was unset."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    old = {k: os.environ.get(k) for k in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Whether version string ``ver`` is at least ``target`` (PEP 440 order)."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(f"is_version_greater_equal_than takes two strings, got {type(ver).__name__} "
                         f"and {type(target).__name__}")
    from packaging import version

    return version.parse(ver) >= version.parse(target)


def _core():
    from dtrun.collectives.horovod import _core  # lazy: this stand-in loads no runtime until asked

    return _core


# verbose: Horovod's argument (it prints why an extension is missing); nothing to print here.
def mpi_built(verbose: bool = False) -> bool: return _core().mpi_built()  # noqa: E704
def gloo_built(verbose: bool = False) -> bool: return _core().gloo_built()  # noqa: E704
def ddl_built(verbose: bool = False) -> bool: return _core().ddl_built()  # noqa: E704
def ccl_built(verbose: bool = False) -> bool: return _core().ccl_built()  # noqa: E704
