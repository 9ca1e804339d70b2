"""A real Slurm cluster on the namespace hosts of tests/nscluster/.

munged and slurmctld run in the root namespace (the "head", which is also where tests
run salloc/sbatch/srun, like a login node); one slurmd runs inside every namespace host
under that host's own name. Everything lives in ``<cluster workdir>/slurm``: the munge
key and socket, slurm.conf, state, spool and logs. Clients find it through
``SLURM_CONF`` (see ``SlurmCluster.env``); nothing under /etc is read or written except
one tagged /etc/hosts line for the head.

Facts this layout rests on (Debian 12, slurm-wlm 22.05, a cgroup v1 host):

* slurmd is started with ``nsenter --net=/var/run/netns/NAME unshare --uts``: under
  ``ip netns exec`` (which remounts /sys) it stops with "No filesystem mounted on
  /sys/fs/cgroup". On cgroup v1 without a cgroup.conf only ``proctrack/linuxproc`` and
  ``task/none`` work.
* slurmctld must be reached on the bridge address, and its host name must resolve to
  it for the other hosts: the machine's own name often maps to 127.0.0.1, so the head
  gets a name of its own (``<prefix>-head``, via a tagged /etc/hosts line) and
  slurmctld runs under it in a UTS namespace.

Library use::

    with Cluster(3) as ns, SlurmCluster(ns) as slurm:
        subprocess.run(["sinfo"], env=slurm.env())
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

from tests import nscluster
from tests.nscluster import Cluster, ClusterError

SLURM_DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/slurmstepd")
MUNGED = "/usr/sbin/munged"
CLIENTS = ("srun", "salloc", "sbatch", "scancel", "squeue", "sinfo", "scontrol", "mungekey", "nsenter")
READY_TIMEOUT = 40.0


def slurm_unavailable_reason() -> Optional[str]:
    """Why a Slurm test cluster cannot run here, or None if it can."""
    reason = nscluster.cluster_unavailable_reason()
    if reason:
        return reason
    for path in SLURM_DAEMONS + (MUNGED,):
        if not os.access(path, os.X_OK):
            return f"{path} missing (apt-get install slurm-wlm munge)"
    for tool in CLIENTS:
        if not shutil.which(tool):
            return f"{tool!r} not found on PATH (apt-get install slurm-wlm munge util-linux)"
    return None


class SlurmCluster:
    """munged + slurmctld on the head, one slurmd per host of ``cluster`` (which must be up).

    Args:
        cluster: an up namespace cluster; its hosts become Slurm nodes named like them.
        cpus: CPUs each node declares (all nodes share this machine's cores).
    """

    def __init__(self, cluster: Cluster, cpus: int = 2) -> None:
        self.cluster = cluster
        self.cpus = cpus
        self.dir = cluster.workdir / "slurm"
        self.head = f"{cluster.prefix}-head"
        self.nodes = [h.name for h in cluster.hosts]
        self.partition = "debug"
        self._procs: list[subprocess.Popen] = []
        self._hosts_marker = f"{nscluster.MARKER}:{cluster.prefix} slurm-head"
        self._munged_pid: Optional[int] = None

    # -- paths -----------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge" / "munge.socket"

    def head_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run under the head's name, as a login node would run it.

        This machine's own name may resolve to 127.0.0.1; MPICH's Hydra tells the nodes to
        call back to the launching host by name, so run it where that name is the bridge's.
        """
        return ["unshare", "--uts", "--", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh",
                self.head, *argv]

    def env(self, base: Optional[Mapping[str, str]] = None, **extra: str) -> dict[str, str]:
        """An environment for Slurm clients of this cluster, without any leftover SLURM_* of ours."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        return self.up()

    def __exit__(self, *exc_info) -> None:
        self.down()

    def up(self) -> "SlurmCluster":
        """Start munged, slurmctld and every slurmd; wait until all nodes are idle."""
        reason = slurm_unavailable_reason()
        if reason:
            raise nscluster.ClusterUnavailable(reason)
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        (self.dir / "munge").mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool", "log", "tmp"):
            (self.dir / sub).mkdir(exist_ok=True)
        nscluster._edit_hosts(self._hosts_marker,
                              [f"{self.cluster.gateway}\t{self.head}\t# {self._hosts_marker}"])
        for name in self.nodes:
            for sub in ("spool", "tmp"):
                (self.dir / sub / name).mkdir(exist_ok=True)
        self._start_munged()
        ctld_port = random.randint(20000, 29000)
        self.conf.write_text(self._slurm_conf(ctld_port, ctld_port + 1))
        env = self.env()
        log = open(self.dir / "log" / "slurmctld.out", "ab")
        self._procs.append(subprocess.Popen(
            ["unshare", "--uts", "--", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", self.head,
             "/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        for host in self.cluster.hosts:
            self._procs.append(subprocess.Popen(
                ["nsenter", f"--net=/var/run/netns/{host.netns}", "unshare", "--uts", "--",
                 "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", host.name,
                 "/usr/sbin/slurmd", "-D", "-N", host.name, "-f", str(self.conf)],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        self._wait_idle()

    def _start_munged(self) -> None:
        key = self.dir / "munge" / "munge.key"
        nscluster._run(["mungekey", "--create", "--force", f"--keyfile={key}"])
        key.chmod(0o400)
        pidfile = self.dir / "munge" / "munged.pid"
        nscluster._run([MUNGED, "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                        f"--pid-file={pidfile}", f"--log-file={self.dir / 'log' / 'munged.log'}",
                        f"--seed-file={self.dir / 'munge' / 'munged.seed'}"])
        self._munged_pid = int(pidfile.read_text().split()[0])

    def _slurm_conf(self, ctld_port: int, slurmd_port: int) -> str:
        d = self.dir
        nodes = ",".join(self.nodes)
        node_lines = "".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs={self.cpus} State=UNKNOWN\n"
                             for h in self.cluster.hosts)
        return (
            f"# test cluster {self.cluster.prefix}, made by tests/slurmcluster.py\n"
            f"ClusterName={self.cluster.prefix}\n"
            f"SlurmctldHost={self.head}({self.cluster.gateway})\n"
            f"SlurmctldPort={ctld_port}\n"
            f"SlurmdPort={slurmd_port}\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            "AuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={self.munge_socket}\n"
            f"StateSaveLocation={d / 'state'}\n"
            f"SlurmdSpoolDir={d / 'spool'}/%n\n"
            f"SlurmctldPidFile={d / 'slurmctld.pid'}\n"
            f"SlurmdPidFile={d / 'spool'}/slurmd.%n.pid\n"
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}\n"
            f"SlurmdLogFile={d / 'log'}/slurmd.%n.log\n"
            "SlurmctldDebug=info\nSlurmdDebug=info\n"
            # cgroup v1 without a cgroup.conf: only these two work (see the module doc)
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
            "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
            "MpiDefault=none\nReturnToService=2\n"
            # quick clean-up between tests: 5 s from SIGTERM to SIGKILL, jobs forgotten soon
            "KillWait=5\nMinJobAge=30\nInactiveLimit=0\nMessageTimeout=10\n"
            "SchedulerParameters=defer\n"
            f"TmpFS={d / 'tmp'}/%n\n"
            + node_lines +
            f"PartitionName={self.partition} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP\n"
        )

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        states = ""
        while time.monotonic() < deadline:
            dead = [p for p in self._procs if p.poll() is not None]
            if dead:
                raise ClusterError(f"{dead[0].args[-5:]} exited {dead[0].returncode}: {self.log_tail()}")
            proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                                  env=self.env(), timeout=15, stdin=subprocess.DEVNULL)
            states = proc.stdout.strip() or proc.stderr.strip()
            idle = [line.split()[0] for line in proc.stdout.splitlines() if line.split()[1:] == ["idle"]]
            if sorted(idle) == sorted(self.nodes):
                return
            time.sleep(0.5)
        raise ClusterError(f"Slurm nodes not idle after {READY_TIMEOUT:g} s: {states}; {self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for log in sorted((self.dir / "log").glob("*")):
            with contextlib.suppress(OSError):
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def jobs(self) -> list[str]:
        """Job ids slurmctld still lists (any state)."""
        proc = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True,
                              env=self.env(), timeout=15, stdin=subprocess.DEVNULL)
        return proc.stdout.split()

    def node_pids(self, needle: str) -> list[int]:
        """PIDs inside the cluster's hosts whose command line contains ``needle``."""
        found = []
        for host in self.cluster.hosts:
            for pid in nscluster._netns_pids(host.netns):
                with contextlib.suppress(OSError):
                    if needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                        found.append(pid)
        return found

    def down(self) -> None:
        """Stop every daemon this cluster started and remove its /etc/hosts line (safe to repeat)."""
        if self.conf.exists() and self._procs:
            with contextlib.suppress(Exception):
                subprocess.run(["scancel", "--full", f"--partition={self.partition}"], env=self.env(),
                               timeout=10, capture_output=True, stdin=subprocess.DEVNULL)
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._procs = []
        # slurmstepd and job processes inside the hosts die with the namespace cluster;
        # kill them here too so the cluster can be reused after this.
        pids = [pid for host in self.cluster.hosts for pid in nscluster._netns_pids(host.netns)
                if _comm(pid) not in ("sshd",)]
        nscluster._kill_and_wait(pids)
        if self._munged_pid:
            nscluster._kill_and_wait([self._munged_pid], signal.SIGTERM, wait=3)
            nscluster._kill_and_wait([self._munged_pid])
            self._munged_pid = None
        nscluster._edit_hosts(self._hosts_marker)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def slurm_cmd(slurm: SlurmCluster, argv: Sequence[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Run a Slurm client command against ``slurm`` with captured text output and a timeout."""
    kw.setdefault("env", slurm.env())
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)
