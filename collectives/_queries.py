"""The module-level queries of a per-process job (``rank()``, ``size()``, ...).

collectives.dp and collectives.horovod both keep the job they started in one object and
offer its fields as functions; each query is made here from the module's own lookup,
which raises that module's "not initialised" error before the job has started.
Standard library only.
"""

from __future__ import annotations

from typing import Any, Callable


def query(lookup: Callable[[str], Any], field: str, doc: str) -> Callable[[], Any]:
    """A function ``field()`` returning ``lookup(field).<field>``, documented by ``doc``."""

    def read() -> Any:
        return getattr(lookup(field), field)

    read.__name__ = read.__qualname__ = field
    read.__doc__ = doc
    read.__module__ = lookup.__module__  # where it is offered, for help() and tracebacks
    return read
