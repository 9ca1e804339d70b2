"""dtrun.collectives.dp and the torch.distributed env:// path on CUDA tensors.

Skipped with the reason on a machine without a CUDA device visible to PyTorch; nothing
is faked. On a GPU machine:  python -m pytest -m gpu tests/test_dp_gpu.py -v

With one GPU both ranks share it: the runtime then stages through host memory (NCCL
needs a GPU per rank) and the NCCL test of torch.distributed is skipped.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.dtrun_helpers import REPO, dtrun, result_records, user_env

pytestmark = pytest.mark.gpu
PYTHON = sys.executable


@pytest.fixture(scope="module")
def cuda_count():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to PyTorch (needs a GPU and a CUDA build of torch)")
    return torch.cuda.device_count()


def test_init_picks_cuda_device_of_local_rank(cuda_count):
    code = ("import json, collectives.dp as dp, torch; c = dp.init(); "
            "print('RESULT ' + json.dumps({'rank': c.rank, 'device': str(c.device), "
            "'current': torch.cuda.current_device()}))")
    p = dtrun("-np", "2", "-H", "localhost:2", "--oversubscribe", PYTHON, "-c", code, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = sorted(result_records(p.stdout),
                 key=lambda r: r["rank"])
    for r in res:
        assert r["device"] == f"cuda:{r['rank'] % cuda_count}" and r["current"] == r["rank"] % cuda_count


@pytest.mark.parametrize("n", [2])
def test_cuda_training_equals_one_rank(cuda_count, tmp_path, n):
    out = tmp_path / "cuda"
    p = dtrun("-np", n, "-H", f"localhost:{n}", "--oversubscribe", PYTHON,
              str(REPO / "tests" / "dp_train.py"), str(out), "--device", "cuda", timeout=300,
              env=user_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ranks = [dict(np.load(out / f"rank.{r}.npz")) for r in range(n)]
    keys = [k[:-5] for k in ranks[0] if k.endswith("-dist")]
    assert len(keys) == 8
    for key in keys:
        # cuDNN/cuBLAS may pick other kernels for B and B/n rows: a looser tolerance.
        np.testing.assert_allclose(ranks[0][f"{key}-dist"], ranks[0][f"{key}-ref"], rtol=1e-4,
                                   atol=1e-5, err_msg=key)
        for r in range(1, n):
            assert ranks[r][f"{key}-dist"].tobytes() == ranks[0][f"{key}-dist"].tobytes(), key


def test_torch_distributed_nccl_under_dtrun(cuda_count):
    if cuda_count < 2:
        pytest.skip(f"NCCL needs one GPU per rank; {cuda_count} visible")
    p = dtrun("-np", "2", "-H", "localhost:2", PYTHON, str(REPO / "tests" / "torchdist_env.py"),
              "nccl", timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = result_records(p.stdout)
    assert sorted(r["sum"] for r in res) == [3.0, 3.0]
    assert len({r["grad"] for r in res}) == 1
