"""Training that survives a restart: resume from the last checkpoint (``dtrun --max-restarts``).

A least-squares model trained with data-parallel SGD: each step, every rank takes its
share of a global batch (the same for any number of ranks), the gradients are summed
across ranks, and every ``--every`` steps rank 0 saves the step and the weights
atomically. A restarted job (dtrun sets ``DTRUN_RESTART_COUNT``, torchrun
``TORCHELASTIC_RESTART_COUNT``) loads the checkpoint and goes on from the step after it,
so it ends with the weights an uninterrupted run ends with.

Two runtimes, the same loop:

* ``--runtime collectives``: dtrun's ``collectives.dp`` (``save_checkpoint``,
  ``load_checkpoint``, ``allreduce_metric``); needs PyTorch.
* ``--runtime mpi4py``: plain mpi4py and numpy, with the same atomic save (temporary
  file, fsync, rename by rank 0; every rank waits for it) written out below.

    dtrun -np 3 --max-restarts 2 python examples/train_resume.py --checkpoint /tmp/ckpt --crash-at 12
"""
from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import stat
import sys
import time

import numpy as np

FEATURES, BATCH = 8, 48


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: the same rows whatever the number of ranks."""
    g = np.random.default_rng(1000 + step)
    x = g.standard_normal((BATCH, FEATURES))
    true_w = np.arange(1, FEATURES + 1, dtype=np.float64) / FEATURES
    return x, x @ true_w + 0.01 * g.standard_normal(BATCH)


def restart_count() -> int:
    return int(os.environ.get("DTRUN_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


class Mpi4pyRuntime:
    """rank, size, a sum across ranks and the checkpoint helpers, with mpi4py alone."""

    def __init__(self):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.rank, self.comm.size

    def allsum(self, a: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        out = np.empty_like(a)
        self.comm.Allreduce(a, out, op=MPI.SUM)
        return out

    def save(self, path: str, state) -> None:
        """Rank 0 writes ``state`` (a step and plain numbers) as NumPy arrays: a format that
        cannot carry code. The temporary file is created exclusively under an unpredictable
        name (a shared directory may hold another user's planted links), synced, then renamed."""
        error = None
        if self.rank == 0:
            tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                               f".{os.path.basename(path)}.tmp-{secrets.token_hex(8)}")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    np.savez(f, step=np.int64(state["step"]), w=np.asarray(state["w"], dtype=np.float64))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)  # a job killed mid-write keeps the previous checkpoint
            except OSError as exc:
                error = f"{path}: {exc}"
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        error = self.comm.bcast(error, root=0)  # every rank returns once it is on disk
        if error:
            raise OSError(error)

    def load(self, path: str):
        """The state rank 0 reads (None for a first run); never follows a link, never unpickles."""
        state, error = None, None
        if self.rank == 0:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        raise OSError(f"{path}: not a regular file")
                    with np.load(f, allow_pickle=False) as z:
                        state = {"step": int(z["step"]), "w": z["w"].tolist()}
            except FileNotFoundError:
                pass
            except (OSError, ValueError, KeyError) as exc:
                error = f"{path}: {exc}"
        state, error = self.comm.bcast((state, error), root=0)
        if error:
            raise OSError(f"cannot load the checkpoint {error}")
        return state


class CollectivesRuntime:
    """The same with dtrun's collectives.dp."""

    def __init__(self):
        import dtrun.collectives.dp as dp

        self.dp = dp
        ctx = dp.init()
        self.rank, self.size = ctx.rank, ctx.size

    def allsum(self, a: np.ndarray) -> np.ndarray:
        import torch

        return self.dp.allreduce_metric(torch.from_numpy(a), op=self.dp.SUM).numpy()

    def save(self, path: str, state) -> None:
        self.dp.save_checkpoint(path, state)

    def load(self, path: str):
        return self.dp.load_checkpoint(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint file (rank 0 writes it)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5, help="save every N steps")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--runtime", choices=("collectives", "mpi4py"), default="mpi4py")
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds each step takes (a slower job)")
    ap.add_argument("--crash-at", type=int, default=None,
                    help="first attempt only: the last rank is killed (SIGKILL) at this step")
    ap.add_argument("--hang-at", type=int, default=None,
                    help="first attempt only: every rank stops making progress at this step")
    args = ap.parse_args()
    rt = CollectivesRuntime() if args.runtime == "collectives" else Mpi4pyRuntime()
    attempt = restart_count()

    state = rt.load(args.checkpoint)
    w, start = (np.zeros(FEATURES), 1) if state is None else (np.asarray(state["w"]), state["step"] + 1)
    if rt.rank == 0:
        print(f"attempt {attempt}: {rt.size} ranks, " +
              ("no checkpoint, step 1" if state is None else f"resumed from step {state['step']}"), flush=True)
    for step in range(start, args.steps + 1):
        if attempt == 0 and step == args.crash_at and rt.rank == rt.size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
        if attempt == 0 and step == args.hang_at:
            time.sleep(3600)
        x, y = batch(step)
        mine = slice(rt.rank, None, rt.size)
        err = x[mine] @ w - y[mine]
        grad = rt.allsum(np.concatenate([x[mine].T @ err, [err @ err]]))
        w = w - args.lr * 2 * grad[:FEATURES] / BATCH
        if rt.rank == 0:
            print(f"step {step} loss {grad[FEATURES] / BATCH:.6f} t={time.time():.3f}", flush=True)
        if step % args.every == 0 or step == args.steps:
            rt.save(args.checkpoint, {"step": step, "w": w.tolist()})
        if args.step_time:
            time.sleep(args.step_time)
    if rt.rank == 0:
        print(f"final w {' '.join(f'{v:.12f}' for v in w)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
