"""GPU arrays (PyTorch CUDA, CuPy) through each path: NCCL, CUDA-aware MPI, staging.

Every test skips with the reason on a machine without a CUDA device or without the
library it needs; nothing is faked. In-process tests run on one rank; the smoke test
with ``--device cuda`` runs 2 ranks (on a single-GPU machine both ranks share the GPU,
so NCCL, which needs one GPU per rank, is skipped and staging is used).

On a GPU machine:  python -m pytest -m gpu tests/test_collectives_gpu.py -v
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _cupy():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:
        return None
    return None


@pytest.fixture(scope="module")
def any_cuda():
    if _torch_cuda() is None and _cupy() is None:
        pytest.skip("no CUDA device visible to torch or cupy (needs a GPU and a CUDA build "
                    "of torch or cupy)")


@pytest.fixture(params=["torch", "cupy"])
def lib(request, any_cuda):
    mod = _torch_cuda() if request.param == "torch" else _cupy()
    if mod is None:
        pytest.skip(f"{request.param} with CUDA is not installed")
    return request.param


def make(lib: str, values, dtype: str = "float32"):
    if lib == "torch":
        import torch
        t = torch.as_tensor(np.asarray(values, dtype=np.float64))
        return t.to(getattr(torch, dtype)).to("cuda")
    import cupy
    return cupy.asarray(np.asarray(values, dtype=dtype))


def host(a) -> np.ndarray:
    if type(a).__module__.startswith("torch"):
        return a.detach().float().cpu().numpy().astype(np.float64) if a.dtype.is_floating_point \
            else a.cpu().numpy().astype(np.float64)
    import cupy
    return cupy.asnumpy(a).astype(np.float64)


def same_kind(a, b) -> bool:
    return type(a) is type(b) and (not hasattr(a, "is_cuda") or a.is_cuda == b.is_cuda)


def fresh_comm(monkeypatch, path: str, lib: str):
    """A communicator whose GPU context was set up for ``path``; skip if unavailable."""
    from mpi4py import MPI

    from dtrun import collectives
    from dtrun.collectives import gpu
    if path != "nccl":
        monkeypatch.setenv("DTRUN_NCCL", "0")
    if path == "staging":
        monkeypatch.setenv("DTRUN_CUDA_AWARE", "0")
    if path == "cuda-aware":
        if not gpu.cuda_aware_mpi():
            pytest.skip("this MPI is not CUDA-aware (MPIX_Query_cuda_support() == 0)")
        if _cupy() is None:
            pytest.skip("the CUDA-aware path works on cupy views; cupy is not installed")
    comm = collectives.Comm(MPI.COMM_WORLD)
    got = gpu.gpu_path(comm, "allreduce", make(lib, [1.0]), "sum")
    if got != path:
        reason = comm._gpu.nccl_error if comm._gpu else ""
        pytest.skip(f"path {path} not available here (got {got}; {reason})")
    return comm


@pytest.mark.parametrize("path", ["nccl", "cuda-aware", "staging"])
def test_gpu_ops_one_rank(monkeypatch, lib, path):
    comm = fresh_comm(monkeypatch, path, lib)
    n = comm.size
    assert n == 1
    x = make(lib, np.arange(12) % 5 + 1)
    r = comm.allreduce(x)
    assert same_kind(r, x) and r is not x
    np.testing.assert_array_equal(host(r), np.arange(12) % 5 + 1)
    out = make(lib, np.zeros(12))
    assert comm.allreduce(x, op="max", out=out) is out
    y = make(lib, np.arange(12) * 1.0)
    assert comm.allreduce(y, op="avg", inplace=True) is y
    np.testing.assert_array_equal(host(y), np.arange(12))
    np.testing.assert_array_equal(host(comm.broadcast(x, root=0)), host(x))
    np.testing.assert_array_equal(host(comm.reduce(x, root=0)), host(x))
    np.testing.assert_array_equal(host(comm.allgather(x)), host(x))
    np.testing.assert_array_equal(host(comm.reduce_scatter(x)), host(x))
    z = make(lib, np.arange(12))
    np.testing.assert_array_equal(host(comm.reduce_scatter(z, inplace=True)), np.arange(12))
    np.testing.assert_array_equal(host(comm.alltoall(x)), host(x))
    w = make(lib, np.arange(12))
    assert comm.alltoall(w, inplace=True) is w
    h = comm.iallreduce(x)
    np.testing.assert_array_equal(host(h.wait()), host(x))
    grads = [make(lib, np.ones(5)), make(lib, np.full(3, 2.0))]
    comm.grouped_allreduce(grads)
    np.testing.assert_array_equal(host(grads[1]), np.full(3, 2.0))
    np.testing.assert_array_equal(host(comm.allgatherv(x)), host(x))
    np.testing.assert_array_equal(host(comm.scatter(x, root=0)), host(x))
    np.testing.assert_array_equal(host(comm.gather(x, root=0)), host(x))
    buf = make(lib, np.zeros(12))
    pending = comm.irecv(buf, source=0, tag=3)
    comm.send(x, 0, tag=3)
    np.testing.assert_array_equal(host(pending.wait()), host(x))
    comm.free()


@pytest.mark.parametrize("path", ["nccl", "staging"])
def test_gpu_half_and_bfloat16_torch(monkeypatch, path):
    if _torch_cuda() is None:
        pytest.skip("torch with CUDA is not installed")
    comm = fresh_comm(monkeypatch, path, "torch")
    for dtype in ("float16", "bfloat16"):
        x = make("torch", np.arange(300) % 7, dtype)
        r = comm.allreduce(x)
        assert r.dtype == x.dtype and r.is_cuda
        np.testing.assert_array_equal(host(r), np.arange(300) % 7)
        avg = comm.allreduce(make("torch", np.full(10, 3.0), dtype), op="avg")
        np.testing.assert_array_equal(host(avg), np.full(10, 3.0))


def test_gpu_errors(any_cuda):
    from dtrun import collectives
    comm = collectives.init()
    lib = "torch" if _torch_cuda() is not None else "cupy"
    x = make(lib, np.zeros((4, 4)))
    with pytest.raises(collectives.NotContiguousError, match="allreduce on rank 0"):
        comm.allreduce(x.t() if lib == "torch" else x.T)


def test_cuda_aware_query_answers(any_cuda):
    from dtrun.collectives import gpu
    assert gpu.cuda_aware_mpi() in (True, False, None)
    assert gpu.device_count() >= 1
    assert gpu.describe_device().startswith("cuda:")


def _launcher(n: int) -> list[str] | None:
    dtrun = os.path.join(os.path.dirname(sys.executable), "dtrun")
    if os.path.exists(dtrun):
        return [dtrun, "-np", str(n), "-H", f"localhost:{n}", "--oversubscribe"]
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *extra, "--oversubscribe", "-np", str(n)]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2])
def test_smoke_cuda(any_cuda, n):
    cmd = _launcher(n)
    if cmd is None:
        pytest.skip("neither dtrun nor mpirun is installed")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd + [sys.executable, "-m", "dtrun.collectives.smoke", "--device", "cuda",
                                 "--timeout", "120"],
                          capture_output=True, text=True, timeout=300, cwd=repo, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "PASS" in proc.stdout and "cuda:" in proc.stdout
