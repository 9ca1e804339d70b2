"""The program dtrun doctor runs on every host: standard library only, fixed code.

It is sent whole over the host's SSH channel (or run locally for this machine)
and reads its parameters as JSON from stdin, so nothing the user typed ever
becomes code or shell text on the far side. It must work on a host whose
environment is broken (no virtual environment on PATH, no ``ip``), so it uses
only the standard library and reports what it could not do instead of failing.

Protocol, one JSON object per line:
  1. in: the request (paths to look at, the launching host's PATH, names to resolve)
     out: the report (environment, resolved programs, interfaces, GPUs, Python,
     the port of a TCP listener kept open for the firewall check)
  2. in: optionally ``{"connect": [[label, addr, port], ...], "ssh": [[label, host], ...]}``
     out: the outcome of each connect and each ssh from this host
  3. in (``dtrun doctor --links``, one host at a time): ``{"links": [[label, addr, port], ...]}``
     out: for each, the round-trip time and the bandwidth to that host's link listener
     (started when the first request has ``"links": true``; its port is ``links_port``)
  then stdin closes and the probe exits, closing its listener.
"""
import sys

if __name__ == "__main__":  # started as a script, or shipped as one program (bundle)
    if "launcher.remote" not in sys.modules:
        import os
        sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import launcher.remote  # noqa: F401 (the package of its siblings, in this process only)
    __package__ = "launcher.remote"  # PEP 366: the relative imports below find the siblings

import json
import os
import shutil
import socket
import subprocess
import threading
import time

from . import sessiondirs

PROBE_VERSION = 1
# Programs whose resolution on PATH the env check reports.
NAMES = ("mpirun", "mpiexec", "prted", "orted", "hydra_pmi_proxy", "python3", "python")
# Where `ip` lives on hosts whose non-interactive PATH is only /usr/bin:/bin.
SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
VERSION_TIMEOUT_S = 5.0
GPU_TIMEOUT_S = 10.0
NCCL_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/cuda/lib64", "/usr/local/nccl/lib",
             "/usr/lib/aarch64-linux-gnu")


def which(name, path):
    return shutil.which(name, path=path) if path is not None else None


def signature(path):
    """(realpath, size, mtime_ns) of a file, or None: equal signatures mean the same binary."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def path_info(path):
    if not path:
        return None
    return {"exists": os.path.exists(path), "exec": os.access(path, os.X_OK),
            "isdir": os.path.isdir(path), "sig": signature(path)}


def run(argv, timeout):
    """(returncode, output) of a short command; never raises."""
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout)
        return p.returncode, p.stdout.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        return None, "timed out after %g s" % timeout
    except OSError as exc:
        return None, str(exc)


def versions(req, resolved):
    """``--version`` output of each MPI launcher that is not the launching host's installation.

    The launcher at the launching host's path, when it is the same file, stands for its
    whole directory (mpirun and mpiexec of one install): no need to run them.
    """
    if not req.get("versions", True):
        return {}
    mine = req.get("paths", {}).get("mpirun")
    same_install = bool(mine) and req.get("mpirun_sig") is not None and signature(mine) == req.get("mpirun_sig")
    out = {}
    for path in {resolved.get("mpirun"), resolved.get("mpiexec"), mine}:
        if not path or path in out or not os.access(path, os.X_OK):
            continue
        if same_install and os.path.dirname(path) == os.path.dirname(mine):
            out[path] = None  # the launching host's installation: same version
            continue
        rc, text = run([path, "--version"], VERSION_TIMEOUT_S)
        out[path] = text[:2000]
    return out


def interfaces():
    """``ip -j addr`` output, or what sysfs and ioctl tell when ``ip`` is missing."""
    ip = shutil.which("ip", path=os.pathsep.join(SBIN))
    if ip:
        rc, text = run([ip, "-j", "addr"], VERSION_TIMEOUT_S)
        if rc == 0:
            return {"source": "ip", "ip_json": text}
    return {"source": "sysfs", "sysfs": sysfs_interfaces()}


def sysfs_interfaces():
    import fcntl
    import struct

    out = []
    try:
        names = sorted(os.listdir("/sys/class/net"))
    except OSError:
        names = [n for _, n in socket.if_nameindex()]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for name in names:
        def read(attr):
            try:
                with open("/sys/class/net/%s/%s" % (name, attr)) as f:
                    return f.read().strip()
            except OSError:
                return None
        item = {"ifname": name, "operstate": read("operstate"), "mtu": read("mtu"), "flags": read("flags")}
        try:
            packed = struct.pack("256s", name.encode()[:15])
            addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, packed)[20:24])  # SIOCGIFADDR
            mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891B, packed)[20:24])  # SIOCGIFNETMASK
            item["inet"] = [addr, mask]
        except OSError:
            item["inet"] = None
        out.append(item)
    s.close()
    return out


def gpus(env_path, ld_path):
    smi = shutil.which("nvidia-smi", path=env_path) or shutil.which("nvidia-smi", path="/usr/bin:/usr/local/bin")
    if not smi:
        return {"nvidia_smi": None}
    rc, text = run([smi, "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"],
                   GPU_TIMEOUT_S)
    return {"nvidia_smi": smi, "rc": rc, "query": text[:8000], "nccl": nccl_libraries(ld_path)}


def nccl_libraries(ld_path):
    """Paths of libnccl.so* on the library path, the usual system places and pip's nvidia-nccl."""
    dirs = [d for d in (ld_path or "").split(os.pathsep) if d] + list(NCCL_DIRS)
    for p in sys.path:
        dirs.append(os.path.join(p, "nvidia", "nccl", "lib"))
        dirs.append(os.path.join(p, "torch", "lib"))
    found = []
    for d in dirs:
        try:
            found += [os.path.join(d, n) for n in os.listdir(d) if n.startswith("libnccl.so")]
        except OSError:
            pass
    return sorted(set(found))[:10]


def python_info(job_python, load_mpi=True):
    """This interpreter, and whether it is the job's Python with a loadable mpi4py."""
    info = {"executable": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3],
            # By path, not by file: a virtual environment's python is a link to the base interpreter.
            "is_job_python": bool(job_python) and os.path.abspath(sys.executable) == os.path.abspath(job_python)}
    if not info["is_job_python"]:
        return info
    try:
        import mpi4py
        info["mpi4py"] = mpi4py.__version__
        if not load_mpi:
            return info
        # Loading the extension links libmpi (a broken LD_LIBRARY_PATH shows here) without MPI_Init.
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        info["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0][:200]
    except Exception as exc:  # ImportError, OSError from dlopen, anything from a broken install
        info["mpi4py_error"] = ("%s: %s" % (type(exc).__name__, exc))[:500]
    return info


class Listener:
    """A TCP listener on an ephemeral port that accepts and closes, for the firewall check."""

    backlog = 256

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(self.backlog)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._handle(conn)

    def _handle(self, conn):
        conn.close()


class LinkListener(Listener):
    """The far end of a link measurement: echoes pings (``p``), counts bulk bytes (``b``)."""

    backlog = 16

    def _handle(self, conn):
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn):
        try:
            conn.settimeout(LINK_IDLE_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mode = conn.recv(1)
            if mode == b"p":
                while True:
                    b = conn.recv(1)
                    if not b:
                        break
                    conn.sendall(b)
            elif mode == b"b":
                total = 0
                while True:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    total += len(chunk)
                conn.sendall(str(total).encode())
        except OSError:
            pass
        finally:
            conn.close()


LINK_IDLE_S = 10.0
LINK_CHUNK = b"\0" * (1 << 16)


def link_one(addr, port, timeout, max_bytes, max_seconds, pings):
    """Round-trip time (median of ``pings`` 1-byte echoes) and bulk bandwidth to one link listener.

    The bulk transfer sends until ``max_bytes`` or ``max_seconds``, then waits for the far
    side's byte count, so data still in socket buffers is counted only once it arrived.
    """
    out = {"rtt_ms": None, "mbps": None, "bytes": 0, "seconds": None, "error": None}
    try:
        with socket.create_connection((addr, port), timeout=timeout) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(b"p")
            rtts = []
            for _ in range(pings):
                t0 = time.perf_counter()
                s.sendall(b"x")
                if not s.recv(1):
                    raise OSError("the link listener closed the connection")
                rtts.append(time.perf_counter() - t0)
            rtts.sort()
            out["rtt_ms"] = round(rtts[len(rtts) // 2] * 1000, 3)
        with socket.create_connection((addr, port), timeout=timeout) as s:
            s.sendall(b"b")
            sent, t0 = 0, time.perf_counter()
            while sent < max_bytes and time.perf_counter() - t0 < max_seconds:
                s.sendall(LINK_CHUNK)
                sent += len(LINK_CHUNK)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(timeout + max_seconds * 4)
            ack = b""
            while True:
                chunk = s.recv(64)
                if not chunk:
                    break
                ack += chunk
            dt = time.perf_counter() - t0
            got = int(ack or b"0")
            out.update(bytes=got, seconds=round(dt, 4), mbps=round(got * 8 / dt / 1e6, 1))
    except (OSError, ValueError) as exc:
        out["error"] = (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)[:200]
    return out


def links(req):
    """Measure each link in turn (never two at once: they would share this host's NIC)."""
    timeout = float(req.get("timeout", 2.0))
    res = {}
    for label, addr, port in req.get("links", []):
        res[label] = link_one(addr, int(port), timeout, int(req.get("max_bytes", 32 << 20)),
                              float(req.get("max_seconds", 0.3)), int(req.get("pings", 10)))
    return {"links": res}


def connect_one(addr, port, timeout):
    t0 = time.monotonic()
    try:
        socket.create_connection((addr, port), timeout=timeout).close()
        status, msg = "ok", ""
    except socket.timeout:
        status, msg = "timeout", "timed out after %g s" % timeout
    except ConnectionRefusedError:
        status, msg = "refused", "refused"
    except OSError as exc:
        status, msg = "error", exc.strerror or str(exc)
    return [status, round(time.monotonic() - t0, 3), msg]


def ssh_one(host, config, timeout):
    """``ssh HOST true`` from this host, never prompting: the hop Open MPI's tree spawn makes."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=%d" % max(1, int(timeout))]
    if config:
        argv += ["-F", config]
    t0 = time.monotonic()
    rc, text = run(argv + ["--", host, "true"], timeout + 5)
    return [rc, round(time.monotonic() - t0, 3), text.strip()[-500:]]


def pairs(req):
    import concurrent.futures as cf

    timeout = float(req.get("timeout", 2.0))
    jobs = {}
    with cf.ThreadPoolExecutor(max_workers=32) as pool:
        for label, addr, port in req.get("connect", []):
            jobs[("connect", label)] = pool.submit(connect_one, addr, int(port), timeout)
        for label, host in req.get("ssh", []):
            jobs[("ssh", label)] = pool.submit(ssh_one, host, req.get("ssh_config"), float(req.get("ssh_timeout", 5)))
    out = {"connect": {}, "ssh": {}}
    for (kind, label), fut in jobs.items():
        out[kind][label] = fut.result()
    return out


def stale_sessions():
    """{"count", "paths"} of this host's stale Open MPI 5 session directories (found with the
    code dtrun removes them with)."""
    found = sessiondirs.stale(sessiondirs.top_dir())
    return {"count": len(found), "paths": found[:20]}


def report(req, listener):
    t0 = time.monotonic()
    env_path = os.environ.get("PATH")
    ld_path = os.environ.get("LD_LIBRARY_PATH")
    names = req.get("names") or NAMES
    resolved = {n: which(n, env_path) for n in names}
    paths = req.get("paths", {})
    rep = {
        "v": PROBE_VERSION,
        "hostname": socket.gethostname(),
        "env": {"PATH": env_path, "LD_LIBRARY_PATH": ld_path},
        "which": resolved,
        # What the ranks see: dtrun forwards the launching host's PATH with -x PATH.
        "which_launch_path": {n: which(n, req.get("launch_path")) for n in names},
        "paths": {k: path_info(v) for k, v in paths.items()},
        "versions": versions(req, resolved),
        "interfaces": interfaces(),
        "gpu": gpus(env_path, ld_path) if req.get("gpu", True) else None,
        "python": python_info(paths.get("python"), req.get("mpi_load", True)),
        "port": listener.port if listener else None,
        "links_port": req.get("links_port"),
        "stale_sessions": stale_sessions(),
    }
    rep["elapsed"] = round(time.monotonic() - t0, 3)
    return rep


def main():
    stdin = sys.stdin.buffer
    req = json.loads(stdin.readline() or b"{}")
    listener = None
    if req.get("listen"):
        try:
            listener = Listener()
        except OSError:
            listener = None
    req["links_port"] = None
    if req.get("links"):
        try:
            req["links_port"] = LinkListener().port
        except OSError:
            pass
    try:
        rep = report(req, listener)
    except Exception as exc:  # report what broke rather than die silently
        rep = {"v": PROBE_VERSION, "error": "%s: %s" % (type(exc).__name__, exc)}
    sys.stdout.write(json.dumps(rep) + "\n")
    sys.stdout.flush()
    # The firewall round's thread pool, imported while doctor reads the reports, not after.
    threading.Thread(target=__import__, args=("concurrent.futures",), daemon=True).start()
    for line in stdin:
        if not line.strip():
            continue
        try:
            ask = json.loads(line)
            out = links(ask) if "links" in ask else pairs(ask)
        except Exception as exc:
            out = {"error": "%s: %s" % (type(exc).__name__, exc)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
