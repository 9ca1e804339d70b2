"""Where torch.distributed's ``env://`` rendezvous meets: MASTER_ADDR and MASTER_PORT.

Scripts written for torchrun call ``init_process_group(init_method="env://")`` and
read RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. The rank wrapper derives the
ranks from MPI; the address and port must be the same on every rank, so dtrun picks
them once, at launch:

* MASTER_ADDR is rank 0's host: the first host of the list (ranks fill each host's
  slots in order, so rank 0 lands there). When every rank runs on this machine it is
  127.0.0.1; a loopback name for this machine in a multi-host list becomes this
  machine's hostname, which the other hosts can resolve.
* MASTER_PORT: when rank 0 runs on this machine, a port the kernel reports free here
  (bound to port 0 and released, as torchrun does). Otherwise dtrun cannot ask rank
  0's host without another ssh round trip, so it draws a random port in
  20000-32767: below Linux's ephemeral range (32768-60999), where the kernel does not
  hand out client ports, so a collision needs another listener on the same port.
  ``-x MASTER_PORT=N`` (or MASTER_ADDR / MASTER_PORT in dtrun's environment) wins.
"""
from __future__ import annotations

import random
import socket
from typing import Mapping, Optional, Sequence

from dtrun.launcher import safe
from dtrun.launcher.errors import InvalidValue, UsageError
from dtrun.launcher.hostfile import HostSlots
from dtrun.launcher.hosts import is_local

LOOPBACK = "127.0.0.1"
REMOTE_PORT_RANGE = (20000, 32767)


def master_addr(hosts: Sequence[HostSlots], local_only: bool, is_local, this_host: str) -> str:
    """Rank 0's host, as the other ranks can reach it (pure)."""
    if local_only or not hosts:
        return LOOPBACK
    first = hosts[0].host
    if is_local(first) and (first == "localhost" or first.startswith("127.") or first == "::1"):
        return this_host
    return first


def free_port() -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def remote_port(rng: Optional[random.Random] = None) -> int:
    lo, hi = REMOTE_PORT_RANGE
    return (rng or random.SystemRandom()).randint(lo, hi)


def choose(hosts: Sequence[HostSlots], local_only: bool, environ: Mapping[str, str],
           user_env: Mapping[str, Optional[str]]) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for this launch.

    A value the user gave with ``-x NAME=VALUE`` or in dtrun's environment is kept
    (validated); otherwise it is chosen as the module docstring says.
    """
    def given(name: str) -> Optional[str]:
        if name in user_env:
            return user_env[name] if user_env[name] is not None else environ.get(name)
        return environ.get(name)

    addr = given("MASTER_ADDR") or master_addr(hosts, local_only, is_local, socket.gethostname())
    try:
        safe.host_name(addr)
    except InvalidValue as e:
        raise UsageError(f"MASTER_ADDR {addr!r} is not a host name or address ({e})") from None
    raw_port = given("MASTER_PORT")
    if raw_port:
        try:
            return addr, safe.port(raw_port)
        except InvalidValue:
            raise UsageError(f"MASTER_PORT {raw_port!r} is not a port number (1-65535)") from None
    rank0_here = local_only or not hosts or is_local(hosts[0].host)
    return addr, free_port() if rank0_here else remote_port()
