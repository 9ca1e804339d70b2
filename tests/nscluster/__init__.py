"""A real multi-host test cluster on one machine, built from Linux network namespaces.

Every host is a network namespace with its own ``eth0`` on a shared bridge, its own
hostname, its own ``sshd`` and its own firewall; all hosts share the file system, so the
project and its virtual environment sit at the same path everywhere (as MPI expects).
The root namespace (the "launching host") sits on the same subnet as ``gateway``.

Library use::

    with Cluster(3, faults={"h2": {"firewall"}}) as cluster:
        subprocess.run(cluster.ssh_argv("h1") + ["hostname"])   # prints "<prefix>-h1"

CLI: ``python -m tests.nscluster up|status|down`` (see ``cli``).

Modules, by concern:

* ``common``: names, paths, errors, ``Host``, and the command and ``/proc`` plumbing;
* ``namespaces``: namespaces, bridge, veth pairs, subnets, /etc/hosts, root iptables;
* ``sshd``: keys, ssh and sshd configuration, each host's environment, the daemons;
* ``faults``: the faults a host can carry and how each is switched on and off;
* ``state``: the state file another process reads back;
* ``teardown``: removal and leftovers by name alone;
* ``cluster``: ``Cluster`` itself, its names and lifecycle;
* ``cli``: the command line.
"""

# Besides __all__, other test modules use MARKER, REPO_ROOT, SSHD, CREATED_PREFIXES and the
# plumbing _run, _kill_and_wait, _edit_hosts, _netns_pids and _parse_fault_specs.
from .cluster import CREATED_PREFIXES, Cluster
from .common import (MARKER, REPO_ROOT, SSHD, STATE_DIR, VENV_BIN, ClusterError, ClusterUnavailable, Host,
                     _kill_and_wait, _run)
from .cli import _parse_fault_specs
from .faults import CLUSTER_FAULTS, FAULTS, HOST_FAULTS
from .namespaces import _edit_hosts, _netns_pids, cluster_unavailable_reason
from .teardown import down_all, down_prefix, leftovers

__all__ = [
    "Host",
    "Cluster",
    "ClusterError",
    "ClusterUnavailable",
    "FAULTS",
    "HOST_FAULTS",
    "CLUSTER_FAULTS",
    "STATE_DIR",
    "VENV_BIN",
    "cluster_unavailable_reason",
    "leftovers",
    "down_all",
    "down_prefix",
]
