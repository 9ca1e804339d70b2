"""Byte counts as people type them: 4096, 64K, 64M, 1G, 4KiB, 2MB (binary units, as nccl-tests).

One parser for the benchmark's ``-b``/``-e`` and the ``DTRUN_*`` size variables.
Standard library only.
"""

from __future__ import annotations

import os
import re

_BYTES = re.compile(r"([0-9]*\.?[0-9]+)\s*([kKmMgG]?)(?:i?[bB])?")


def parse_bytes(text: str) -> int:
    """'8', '1K', '64M', '1G', '4KiB', '2MB' -> bytes (K = 1024).

    Raises:
        ValueError: ``text`` is not a byte count.
    """
    m = _BYTES.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a byte count (e.g. 64M)")
    unit = m.group(2).upper()
    return int(float(m.group(1)) * (1 << (10 * ("KMG".index(unit) + 1)) if unit else 1))


def env_bytes(name: str, default: int) -> int:
    """The byte count in environment variable ``name``, or ``default`` when unset or empty.

    Raises:
        ValueError: the variable holds something else (the message names it).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse_bytes(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a byte count (e.g. 64M)") from None
