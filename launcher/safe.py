"""The one gate for values that leave dtrun: grammars, and quoting for each consumer.

Every value from the user (command line, hostfile, cluster file, Slurm's variables)
that reaches another program's argument string or a file dtrun generates is checked
here, by a grammar that admits only what that consumer reads literally:

* host names (DNS labels, dotted-quad IPv4, IPv6 with an interface-name zone id),
  user names, ports and counts;
* paths written into an ssh config, quoted for OpenSSH's ssh_config reader (which
  splits on spaces, honours ``"`` and ``\\``, and expands ``%`` tokens, ``${VAR}`` and,
  for Include, globs);
* words inside an Open MPI MCA value that Open MPI splits on spaces itself
  (``plm_ssh_args``: PRRTE and ORTE split it with ``argv_split(value, ' ')``, no quoting);
* MCA keys and values, environment names and values, interface names and subnets.

No value may contain a newline or another control character: one newline in a
generated ssh config adds a directive (``ProxyCommand``, ``Match exec``) that runs a
command. Functions raise ``InvalidValue`` with the reason; callers add where the
value came from.
"""
from __future__ import annotations

import ipaddress
import re
import shlex

from dtrun.launcher.errors import InvalidValue

MAX_SLOTS = 4096  # per host; far above any real node's cores or GPUs
MAX_RANKS = 1 << 20  # -np
MAX_HOSTS = 65536  # hosts in one job (Slurm node lists are expanded at most this far)

_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_ZONE = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # an interface name or index after '%'
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}")
_INT = re.compile(r"-?[0-9]+")  # ASCII only: int() also takes '٣', '1_0', '+4' and ' 4'
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
_MCA_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,127}")
# MCA values reach the daemons' command lines on remote hosts, which ORTE/PRRTE build as shell
# text: only characters no shell treats specially (plus the space, which they quote).
_MCA_VALUE = re.compile(r"[A-Za-z0-9_.,:/@^+=%~ -]{0,1024}")
_MCA_WORD = re.compile(r"[A-Za-z0-9_.,:/@^+=%~-]{1,4096}")
_IFACE = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")  # Linux IFNAMSIZ is 16 with the NUL
# Characters an ssh_config path value cannot carry literally (see module docstring).
_SSH_PATH_BAD = set('"\\$%*?[')


def _has_control(value: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in value)


def _show(value: str) -> str:
    return repr(value) if len(value) <= 80 else repr(value[:77]) + "..."


# ---- hosts ---------------------------------------------------------------------------------------

def host_name(name: str) -> str:
    """``name`` if it is a host name, a dotted-quad IPv4 or an IPv6 address (zone: ``%ifname``).

    Raises:
        InvalidValue: anything else, including names that only look like addresses
            (``999.1.1.1``, ``1.2.3.4.5``) and zone ids with spaces or shell characters.
    """
    if not isinstance(name, str) or not name:
        raise InvalidValue("empty host name")
    if len(name) > 253 or not name.isascii() or _has_control(name):
        raise InvalidValue(f"invalid host name {_show(name)}")
    if ":" in name:
        addr, pct, zone = name.partition("%")
        try:
            ipaddress.IPv6Address(addr)
        except ValueError:
            raise InvalidValue(f"invalid IPv6 address {_show(name)}") from None
        if pct and not _ZONE.fullmatch(zone):
            raise InvalidValue(f"invalid IPv6 zone id {_show(zone)} in {_show(name)} (an interface name: letters, "
                               f"digits, '.', '_' and '-')")
        return name
    labels = name.split(".")
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            raise InvalidValue(f"invalid IPv4 address {_show(name)} (four numbers 0-255)") from None
        return name
    if not all(_LABEL.fullmatch(label) for label in labels):
        raise InvalidValue(f"invalid host name {_show(name)} (letters, digits, '-', '_' and '.' only; "
                           f"no leading '-')")
    return name


def user_name(value: str) -> str:
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise InvalidValue(f"invalid user name {_show(str(value))} (letters, digits, '_', '.', '-'; at most 32)")
    return value


def count(value, what: str, maximum: int) -> int:
    """A positive integer written in ASCII digits (no sign, '_' or other scripts), at most ``maximum``."""
    text = str(value)
    if not _INT.fullmatch(text):
        raise InvalidValue(f"{what} must be a positive integer, got {_show(text)}")
    if len(text) > 12:
        raise InvalidValue(f"{what} must be at most {maximum}, got {text[:12]}...")
    n = int(text)
    if n <= 0:
        raise InvalidValue(f"{what} must be a positive integer, got {n}")
    if n > maximum:
        raise InvalidValue(f"{what} must be at most {maximum}, got {n}")
    return n


def port(value) -> int:
    try:
        return count(value, "port", 65535)
    except InvalidValue:
        raise InvalidValue(f"port must be 1-65535, got {_show(str(value))}") from None


def seconds(value: float, flag: str, maximum: float = 86400.0) -> float:
    """A finite, positive number of seconds (``nan``, ``inf``, 0 and negatives are refused)."""
    import math

    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 or value > maximum:
        raise InvalidValue(f"{flag} must be positive and finite (seconds, at most {maximum:g}), got {value:g}"
                           if isinstance(value, (int, float)) else f"{flag} must be a number of seconds, got {value!r}")
    return float(value)


# ---- environment, MCA, interfaces ---------------------------------------------------------------

def env_item(item: str) -> tuple[str, str | None]:
    """``NAME`` (forward by name) or ``NAME=VALUE`` from -x."""
    name, eq, value = item.partition("=")
    if not _ENV_NAME.fullmatch(name):
        raise InvalidValue(f"-x {_show(item)}: {_show(name)} is not a valid environment variable name")
    if eq and _has_control(value):
        raise InvalidValue(f"-x {name}: the value contains a newline or another control character")
    return name, (value if eq else None)


def mca_key(key: str) -> str:
    if not isinstance(key, str) or not _MCA_KEY.fullmatch(key):
        raise InvalidValue(f"--mca: invalid parameter name {_show(str(key))} (letters, digits and '_', "
                           f"like btl_tcp_if_include)")
    return key


def mca_value(key: str, value: str) -> str:
    if not isinstance(value, str) or not _MCA_VALUE.fullmatch(value):
        raise InvalidValue(f"--mca {key}: value {_show(str(value))} has characters Open MPI passes through a remote "
                           f"shell (allowed: letters, digits, space and _ . , : / @ ^ + = % ~ -)")
    return value


def iface(value: str, flag: str) -> str:
    """An interface name (``eth0``) or an IPv4/IPv6 subnet (``10.0.0.0/24``)."""
    if "/" in value:
        try:
            return str(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise InvalidValue(f"{flag}: invalid subnet {_show(value)}") from None
    if not _IFACE.fullmatch(value):
        raise InvalidValue(f"{flag}: invalid interface name {_show(value)}")
    return value


# ---- quoting for each consumer -------------------------------------------------------------------

def ssh_config_path(path: str, what: str) -> str:
    """``path`` as one ssh_config argument: double-quoted, so spaces are safe.

    Raises:
        InvalidValue: the path holds a character OpenSSH would read as syntax or expand
            (``"``, ``\\``, ``$``, ``%``, glob characters) or a control character.
    """
    bad = sorted({c for c in path if c in _SSH_PATH_BAD})
    if not path or _has_control(path) or bad:
        shown = "a newline or control character" if _has_control(path) else " ".join(bad) or "nothing"
        raise InvalidValue(f"{what} {_show(path)}: an ssh config cannot hold this path ({shown}); "
                           f"rename the file or move it to a plain path")
    return f'"{path}"'


def ssh_config_word(value: str, what: str) -> str:
    """A bare ssh_config argument (host pattern, user, port): no space, quote or control character."""
    if not value or _has_control(value) or any(c in value for c in ' \t"\'\\#'):
        raise InvalidValue(f"{what} {_show(value)} cannot be written into an ssh config")
    return value


def is_mca_word(value: str) -> bool:
    """Whether ``value`` passes ``mca_word``."""
    return bool(_MCA_WORD.fullmatch(value))


def mca_word(value: str, what: str) -> str:
    """One word inside an MCA value that Open MPI splits on spaces itself (``plm_ssh_args``)."""
    if not _MCA_WORD.fullmatch(value):
        raise InvalidValue(f"{what} {_show(value)} cannot be passed inside an Open MPI argument string "
                           f"(it splits on spaces and does not quote)")
    return value


def plain_text(value: str, what: str) -> str:
    """A non-empty value without newlines or other control characters (tab allowed)."""
    if not value or any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in value):
        raise InvalidValue(f"{what} {_show(value)}: empty, or contains a newline or another control character")
    return value


def shell_word(value: str) -> str:
    """``value`` quoted for a POSIX shell script (the Hydra launcher wrapper)."""
    if _has_control(value):
        raise InvalidValue(f"{_show(value)} contains a newline or another control character")
    return shlex.quote(value)
