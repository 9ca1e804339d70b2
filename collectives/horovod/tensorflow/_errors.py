"""The TensorFlow errors of the Horovod adapter, as Horovod's TensorFlow ops raise them.

Horovod's ops fail with ``tf.errors.FailedPreconditionError`` when ranks submit the same
collective with different shapes, dtypes, ranks of tensors or root ranks, and with
``tf.errors.InvalidArgumentError`` for an argument one rank can tell is wrong (alltoall
splits, a scalar to reducescatter). The adapter's classes are those TensorFlow errors and
also the runtime's (``HorovodMismatchError``, a ValueError and a RuntimeError), so
``except`` clauses written for either keep working, and the message still names the
ranks that differ.

In a graph (``tf.function``, ``tf.compat.v1`` sessions) a collective runs inside
``tf.py_function``, whose kernel turns a Python exception into a status by its Python type
only: a ValueError becomes InvalidArgument and anything else Unknown, never
FailedPrecondition. So inside a graph a mismatch is raised as ``HorovodPreconditionFailed``
(an Unknown status whose message carries that name), and ``install()`` has TensorFlow build
the adapter's FailedPrecondition error from exactly those messages; every other Unknown
error is built as before.
"""

from __future__ import annotations

import tensorflow as tf

from .. import _core
from ...errors import CollectiveError

_MARKER = "HorovodPreconditionFailed: "


def _init(err, node_def, op, message, code, rank=None) -> None:
    """Fill in both halves of an adapter error (``OpError.__init__`` would call the
    runtime error's ``__init__`` without arguments, and ``op`` is OpError's read-only
    property, so neither base's ``__init__`` runs)."""
    BaseException.__init__(err, message)
    err._node_def, err._op, err._message, err._error_code = node_def, op, message, code
    err._experimental_payloads = {}
    err.rank, err.problem = rank, message


class HorovodPreconditionError(tf.errors.FailedPreconditionError, _core.HorovodMismatchError):
    """Ranks submitted one collective with different shapes, dtypes or root ranks
    (Horovod's FailedPreconditionError; also the runtime's HorovodMismatchError)."""

    def __init__(self, node_def=None, op=None, message: str = "", *args, rank=None):
        _init(self, node_def, op, message,
              tf.errors.FAILED_PRECONDITION, rank)


class HorovodInvalidArgumentError(tf.errors.InvalidArgumentError, CollectiveError, ValueError):
    """An argument this rank can tell is wrong (Horovod's InvalidArgumentError; also a
    ValueError)."""

    def __init__(self, node_def=None, op=None, message: str = "", *args, rank=None):
        _init(self, node_def, op, message,
              tf.errors.INVALID_ARGUMENT, rank)


class _GraphPreconditionError(HorovodPreconditionError, tf.errors.UnknownError):
    """``HorovodPreconditionError`` as built from an Unknown status: TensorFlow raises the
    class of the status's code, and Python keeps an object built for that class only if
    it is an instance of it. Its message is the mismatch's, without the carrier's name
    and the traceback TensorFlow appends."""

    def __init__(self, node_def=None, op=None, message: str = "", *args, rank=None):
        at = message.find(_MARKER)
        if at >= 0:
            message = message[at + len(_MARKER):]
            end = message.find("\nTraceback (most recent call last):")
            message = message if end < 0 else message[:end]
        super().__init__(node_def, op, message, rank=rank)


class HorovodPreconditionFailed(Exception):
    """What a mismatch raises inside ``tf.py_function``: TensorFlow reports it as Unknown
    and ``install()`` turns it back into ``HorovodPreconditionError``."""


def invalid_argument(kind: str, rank: int, problem: str) -> HorovodInvalidArgumentError:
    return HorovodInvalidArgumentError(None, None, f"{kind} on rank {rank}: {problem}", rank=rank)


def translate(err: BaseException, in_graph: bool) -> BaseException:
    """The error a collective raises for the runtime's ``err``: a mismatch becomes
    FailedPrecondition (inside a graph: the carrier that becomes it); others stay."""
    if isinstance(err, _core.HorovodMismatchError) and not isinstance(err, tf.errors.OpError):
        if in_graph:
            return HorovodPreconditionFailed(str(err))
        return HorovodPreconditionError(None, None, str(err), rank=getattr(err, "rank", None))
    return err


def install() -> None:
    """Have ``tf.errors.UnknownError(node_def, op, message)`` build a
    ``HorovodPreconditionError`` when ``message`` carries ``HorovodPreconditionFailed``
    (TensorFlow builds its errors from a status by calling the class of its code)."""
    unknown = tf.errors.UnknownError
    if getattr(unknown, "_hvd_installed", False):
        return

    def __new__(cls, *args, **kwargs):  # noqa: N807
        if cls is unknown and len(args) >= 3 and _MARKER in str(args[2]):
            cls = _GraphPreconditionError  # Python then runs its __init__ with these args
        return Exception.__new__(cls, *args, **kwargs)
    unknown.__new__ = staticmethod(__new__)
    unknown._hvd_installed = True
