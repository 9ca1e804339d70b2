"""Handles for non-blocking operations: ``wait()`` and ``test()``."""

from __future__ import annotations

from typing import Any, Callable

from .errors import CollectiveError, MPIError


class Handle:
    """A pending operation started by ``isend``/``irecv``/``iallreduce``/... .

    ``wait()`` blocks until it is done and returns the result (the output array,
    or None for sends); ``test()`` returns True once it is done without blocking.
    Post-processing that must follow completion (dividing for an average, copying
    a staged GPU buffer back) runs exactly once, in whichever call sees completion.
    The handle keeps the buffers alive until then, so callers may drop their own
    references safely.
    """

    __slots__ = ("_request", "_result", "_post", "_done", "_keep", "op")

    def __init__(self, request: Any, result: Any, post: Callable[[Any], Any] | None = None,
                 keep: Any = None, op: str = "") -> None:
        self._request = request  # MPI.Request, or any object with Wait()/Test(), or None
        self._result = result
        self._post = post
        self._done = request is None
        self._keep = keep
        self.op = op
        if self._done:
            self._finish()

    def _finish(self) -> None:
        self._done = True
        if self._post is not None:
            post, self._post = self._post, None
            self._result = post(self._result)
        self._keep = None

    def wait(self) -> Any:
        """Block until the operation completes; return its result.

        Raises:
            MPIError: MPI reported an error for this operation (e.g. truncation).
        """
        if not self._done:
            try:
                self._request.Wait()
            except Exception as e:
                raise _translate(self.op, e) from None
            self._finish()
        return self._result

    def test(self) -> bool:
        """True if the operation has completed (and its result is ready)."""
        if not self._done:
            try:
                done = self._request.Test()
            except Exception as e:
                raise _translate(self.op, e) from None
            if done:
                self._finish()
        return self._done

    # MPI.Request spelling, so a Handle can wrap another Handle (adapters do).
    def Wait(self) -> None:  # noqa: N802
        self.wait()

    def Test(self) -> bool:  # noqa: N802
        return self.test()

    @property
    def done(self) -> bool:
        return self._done

    def __repr__(self) -> str:
        return f"<Handle {self.op or 'op'} {'done' if self._done else 'pending'}>"


def _translate(op: str, exc: Exception) -> Exception:
    """MPI errors become MPIError naming the operation; ours pass through unchanged."""
    if isinstance(exc, CollectiveError):
        return exc
    text = exc.Get_error_string() if hasattr(exc, "Get_error_string") else str(exc)
    return MPIError(op or "wait", None, f"MPI error: {text}")


def wait_all(handles: list[Handle]) -> list[Any]:
    """Wait for every handle; return their results in order."""
    return [h.wait() for h in handles]
