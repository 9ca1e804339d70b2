"""paramiko, loaded only by the commands that connect (doctor, keyscan, a multi-host preflight).

paramiko costs about half a second to import, so no module imports it at its top:
each function that needs it calls ``import_paramiko``, which also skips the import of
invoke that paramiko.config would make, and silences paramiko's own logging. It is a
module of its own because the ssh config reader, the known_hosts reader and the
connection all need it, and none of them should import the others for it.
"""
from __future__ import annotations

import sys


def import_paramiko():
    """paramiko, without the 80 ms import of invoke that paramiko.config makes only for ``Match exec``.

    dtrun does not evaluate ``Match exec`` (``ssh_target`` says so if a config uses it), so
    ``import invoke`` is made to fail while paramiko loads, which paramiko.config tolerates.
    """
    if "paramiko" in sys.modules or "invoke" in sys.modules:
        import paramiko

        return paramiko
    sys.modules["invoke"] = None  # type: ignore[assignment]  # import invoke -> ImportError
    try:
        import paramiko
    finally:
        del sys.modules["invoke"]  # anyone else importing invoke later gets the real one
    # paramiko's transport threads log their own failures (a closed socket after a handshake that
    # timed out prints a traceback through logging's last-resort handler); dtrun reports each one itself.
    import logging

    logging.getLogger("paramiko").addHandler(logging.NullHandler())
    return paramiko
