"""Point-to-point messages between two ranks: send, recv, their non-blocking forms, sendrecv.

No signature exchange and no recorder entry (they are not collectives); the same
argument checks and MPI error translation as the collectives. ``Comm`` inherits them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._mpi import MPI
from .handle import Handle

ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG


class PointToPoint:
    """Send and receive of ``Comm`` (a mixin)."""

    def send(self, x: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of array ``x`` to rank ``dest``."""
        if type(x) is not np.ndarray:
            return self._foreign("send", x, dest, tag)
        t = self._type(x, "send")
        with self._errors("send"):
            self.mpi.Send([x, t], dest, tag)

    def recv(self, out: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Any:
        """Blocking receive into ``out`` (shape/dtype as sent); returns ``out``."""
        if type(out) is not np.ndarray:
            return self._foreign("recv", out, source, tag)
        t = self._type(out, "recv")
        with self._errors("recv"):
            self.mpi.Recv([out, t], source, tag)
        return out

    def isend(self, x: Any, dest: int, tag: int = 0) -> Handle:
        """Non-blocking send; ``wait()`` returns None. Do not modify ``x`` before."""
        if type(x) is not np.ndarray:
            return self._foreign("isend", x, dest, tag)
        t = self._type(x, "isend")
        with self._errors("isend"):
            return Handle(self.mpi.Isend([x, t], dest, tag), None, keep=x, op="isend")

    def irecv(self, out: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Handle:
        """Non-blocking receive into ``out``; ``wait()`` returns ``out``."""
        if type(out) is not np.ndarray:
            return self._foreign("irecv", out, source, tag)
        t = self._type(out, "irecv")
        with self._errors("irecv"):
            return Handle(self.mpi.Irecv([out, t], source, tag), out, op="irecv")

    def sendrecv(self, x: Any, dest: int, out: Any, source: int = ANY_SOURCE,
                 sendtag: int = 0, recvtag: int = ANY_TAG) -> Any:
        """Send ``x`` to ``dest`` and receive into ``out`` at once (no deadlock)."""
        if type(x) is not np.ndarray or type(out) is not np.ndarray:
            return self._foreign("sendrecv", x, dest, out, source, sendtag, recvtag)
        t, u = self._type(x, "sendrecv"), self._type(out, "sendrecv")
        with self._errors("sendrecv"):
            self.mpi.Sendrecv([x, t], dest, sendtag, [out, u], source, recvtag)
        return out
