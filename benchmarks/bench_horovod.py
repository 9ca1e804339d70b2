"""`make bench` driver: Horovod's API on dtrun (collectives.horovod) against its peers.

PyTorch (bench_ddp.py's MLP, 2 ranks on localhost, one job): the step time (zero_grad,
forward, backward, step) of

* ``hvd``: ``collectives.horovod.torch.DistributedOptimizer`` (goal: at most 2 % slower
  than ``dp``: it is collectives.dp's optimizer behind Horovod's argument names);
* ``dp``: ``collectives.dp.DistributedOptimizer``;
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with gloo;

taking turns round after round (a noisy neighbour hurts all alike); each round records
the median step of every variant, the max over ranks.

TensorFlow/Keras (the same MLP in Keras 3, 2 ranks, one job, alternating rounds): a Keras
``train_on_batch`` step with ``collectives.horovod.keras.DistributedOptimizer``, and a
GradientTape step in ``tf.function`` with ``DistributedGradientTape`` against the same step
under TensorFlow's own ``MultiWorkerMirroredStrategy`` (its collective all-reduce between
the same two processes, TF_CONFIG from a free port per rank). Where the strategy cannot
start, the row says why.

Real Horovod (``--real-horovod PYTHON``: the Python of an environment where Horovod 0.28.1
is built with PyTorch and Gloo, ``horovodrun`` beside it) against the adapter, the same
unchanged code under both engines, ``horovodrun --gloo -np 2`` and ``dtrun --horovod -np 2``,
one job per engine and round, the engines taking turns (the first one alternates), with
one compute thread per rank under both (OMP_NUM_THREADS=1; each job reports what its ranks
got):

* the MLP step above with ``import horovod.torch as hvd`` and ``hvd.DistributedOptimizer``
  (median step of the round, the max over ranks);
* Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py``, unchanged, from
  ``--horovod-examples`` (a Horovod checkout), images per second per rank as it prints them;
  it needs torchvision's models importable by both Pythons (PYTHONPATH is passed on).

Without ``--real-horovod`` (or where it cannot run) that part is skipped with the reason.

Writes bench-results/horovod.md and horovod.json (and horovod-real.md/.json) and prints the
tables, with the load average. Exit code 0 unless a run fails: a missed goal is a finding.

    python benchmarks/bench_horovod.py [--rounds N] [--steps N]
        [--real-horovod PYTHON [--horovod-examples DIR] [--real-rounds N] [--only-real]]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (BIN, OUT_DIR, REPO, add_timing_args, run_bench_job, timed_rounds,  # noqa: E402
                     timing_argv, write_table)
from bench_ddp import BATCH, DEPTH, WIDTH, batch, fresh_model, make_step  # noqa: E402



# ----------------------------------------------------------------------------- torch job
def torch_worker(args) -> None:
    import torch

    import dtrun.collectives.dp as dp
    import dtrun.collectives.horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    import torch.distributed as dist
    from datetime import timedelta

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    x, y = batch(hvd.rank())
    runners = {}
    for mode in ["hvd", "dp", "ddp"]:
        model, opt = fresh_model()
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif mode == "dp":
            opt = dp.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        else:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        runners[mode] = make_step(model, opt, x, y)
    rounds = timed_rounds(runners, args, lambda v: dp.allreduce_metric(v, op="max"))
    if hvd.rank() == 0:
        print("BENCH " + json.dumps({"rounds": rounds}), flush=True)
    import gc

    runners.clear()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


# ----------------------------------------------------------------------------- TF job
def tf_worker(args) -> None:
    import socket

    from dtrun import collectives
    comm = collectives.init()
    # TF_CONFIG for MultiWorkerMirroredStrategy: one port per rank, picked on its own host.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    import numpy as np
    ports = comm.allgather(np.array([port], dtype=np.int64)).tolist()
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": comm.rank}})
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import dtrun.collectives.horovod.keras as hvd
    import dtrun.collectives.horovod.tensorflow as hvd_tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy, skipped = None, None
    try:  # first: the strategy configures TF's collectives at start-up, before any op
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    except Exception as e:  # noqa: BLE001 — reported in the table
        skipped = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((BATCH, 256)).astype(np.float32)
    y = rng.integers(0, 10, BATCH)

    def keras_model():
        keras.utils.set_random_seed(0)
        layers = [keras.Input((256,))] + [keras.layers.Dense(WIDTH, activation="relu")
                                          for _ in range(DEPTH)] + [keras.layers.Dense(10)]
        return keras.Sequential(layers)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    runners = {}
    model = keras_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss=loss)
    runners["hvd-fit"] = lambda: model.train_on_batch(x, y)
    xt, yt = tf.constant(x), tf.constant(y)
    tape_model = keras_model()
    tape_opt = keras.optimizers.SGD(0.01, momentum=0.9)

    @tf.function
    def hvd_step():
        with tf.GradientTape() as tape:
            value = loss(yt, tape_model(xt, training=True))
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(value, tape_model.trainable_variables)
        tape_opt.apply_gradients(zip(grads, tape_model.trainable_variables))
    runners["hvd-tape"] = hvd_step
    if strategy is not None:
        with strategy.scope():
            mw_model = keras_model()
            mw_opt = keras.optimizers.SGD(0.01, momentum=0.9)

        def replica_step():
            with tf.GradientTape() as tape:
                value = loss(yt, mw_model(xt, training=True))
            grads = tape.gradient(value, mw_model.trainable_variables)
            mw_opt.apply_gradients(zip(grads, mw_model.trainable_variables))  # all-reduced

        @tf.function
        def mw_step():
            strategy.run(replica_step)
        runners["mwms-tape"] = mw_step
    rounds = timed_rounds(runners, args, lambda v: float(
        hvd.allreduce(np.array([v]), op=hvd.Max).numpy()[0]))
    if hvd.rank() == 0:
        print("BENCH " + json.dumps({"rounds": rounds, "skipped": skipped}), flush=True)


# ----------------------------------------------------------------------------- real Horovod
def hvd_mlp_worker(args) -> None:
    """The MLP step through ``import horovod.torch``: real Horovod under horovodrun, the
    adapter under ``dtrun --horovod`` (the same code, so the engines are all that differs)."""
    import torch

    import horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    x, y = batch(hvd.rank())
    model, opt = fresh_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    rounds = timed_rounds({"step": make_step(model, opt, x, y)}, args,
                          lambda v: hvd.allreduce(torch.tensor([v]), op=hvd.Max).item())
    if hvd.rank() == 0:
        print("BENCH " + json.dumps({"rounds": rounds["step"], "module": hvd.__name__}), flush=True)


def thread_probe() -> None:
    """Print what a rank of this engine gets: torch's compute threads and its horovod module."""
    import torch

    import horovod.torch as hvd

    print("BENCH " + json.dumps({"threads": torch.get_num_threads(), "module": hvd.__name__}),
          flush=True)


def real_engines(args) -> tuple[dict, str]:
    """{name: Engine} for real Horovod and the adapter, or ({}, why not)."""
    from horovod_suite import Engine

    py = Path(args.real_horovod) if args.real_horovod else None
    if py is None:
        return {}, "no --real-horovod PYTHON given (the Python where Horovod 0.28.1 is built)"
    hr = py.parent / "horovodrun"
    if not (py.exists() and hr.exists()):
        return {}, f"{py} or {hr} does not exist"
    dt = str(BIN / "dtrun")
    if "--horovod" not in subprocess.run([dt, "--help"], capture_output=True, text=True,
                                         timeout=60).stdout:
        return {}, f"{dt} has no --horovod option"
    return {"horovod": Engine("horovodrun", [str(hr)], str(py)),
            "dtrun": Engine("dtrun", [dt, "--horovod", "-x", "OMP_NUM_THREADS=1"], sys.executable)}, ""


def engine_job(engine, argv: list[str], timeout: float) -> str:
    """Run ``argv`` as a 2-rank job of ``engine`` from the repository; its output. Exits
    naming the command when the job fails; kills the whole job when it runs past ``timeout``."""
    from horovod_suite import TAG_VAR, kill_job

    cmd = [*engine.argv(2), engine.python, *argv]
    tag = os.urandom(8).hex()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{TAG_VAR: tag})
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc, tag)
        sys.exit(f"bench_horovod: {' '.join(cmd)} ran past {timeout:.0f} s: killed")
    kill_job(proc, tag)
    if proc.returncode != 0:
        sys.exit(f"bench_horovod: {' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return out


def bench_doc(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if "BENCH {" in ln)
    return json.loads(line[line.index("{"):])


def synthetic_example(args) -> tuple[Path | None, str]:
    """Horovod's pytorch_synthetic_benchmark.py under --horovod-examples, or (None, why not)."""
    if not args.horovod_examples:
        return None, "no --horovod-examples DIR given (a Horovod checkout)"
    base = Path(args.horovod_examples)
    for p in (base / "examples" / "pytorch", base / "pytorch", base):
        if (p / "pytorch_synthetic_benchmark.py").is_file():
            return p / "pytorch_synthetic_benchmark.py", ""
    return None, f"no examples/pytorch/pytorch_synthetic_benchmark.py under {base}"


def real_comparison(args) -> None:
    """Real Horovod against the adapter, engines taking turns job by job."""
    engines, why = real_engines(args)
    if not engines:
        print(f"real Horovod: skipped: {why}")
        return
    example, why_not = synthetic_example(args)
    ex_argv = [] if example is None else [
        str(example), "--model", args.model, "--batch-size", str(args.batch_size),
        "--num-warmup-batches", "2", "--num-batches-per-iter", "3", "--num-iters", "3"]
    me = str(Path(__file__).resolve())
    probe = {n: bench_doc(engine_job(e, [me, "--worker", "probe"], 300)) for n, e in engines.items()}
    load0 = os.getloadavg()
    mlp: dict[str, list[float]] = {n: [] for n in engines}
    img: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(args.real_rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            doc = bench_doc(engine_job(engines[name], [me, "--worker", "hvd-mlp", *timing_argv(args)],
                                       900))
            mlp[name].append(statistics.median(doc["rounds"]))
            if ex_argv:
                out = engine_job(engines[name], ex_argv, 1800)
                img[name].append(float(re.findall(r"Img/sec per CPU: ([\d.]+)", out)[-1]))
    report_real(args, engines, probe, mlp, img, why_not, load0)


def report_real(args, engines, probe, mlp, img, why_not, load0) -> None:
    """Print and write the real-Horovod table (bench-results/horovod-real.md and .json)."""
    load1 = os.getloadavg()
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(a, b))  # noqa: E731
    cmd = {n: " ".join([*e.argv(2), e.python]) for n, e in engines.items()}
    rows = [("MLP step, real Horovod 0.28.1", f"{1000 * med(mlp['horovod']):.1f} ms", cmd["horovod"]),
            ("MLP step, dtrun --horovod (adapter)", f"{1000 * med(mlp['dtrun']):.1f} ms",
             f"{ratio(mlp['horovod'], mlp['dtrun']):.2f}x real Horovod's speed "
             "(median of per-round ratios)")]
    if img["horovod"]:
        ex = f"pytorch_synthetic_benchmark.py --model {args.model} --batch-size {args.batch_size}"
        rows += [(f"{ex}, real Horovod 0.28.1", f"{med(img['horovod']):.2f} img/s per rank", ""),
                 (f"{ex}, dtrun --horovod (adapter)", f"{med(img['dtrun']):.2f} img/s per rank",
                  f"{ratio(img['dtrun'], img['horovod']):.2f}x real Horovod's speed")]
    else:
        rows.append(("pytorch_synthetic_benchmark.py", "-", f"skipped: {why_not}"))
    threads = ", ".join(f"{n}: {p['threads']} ({p['module']})" for n, p in probe.items())
    head = (f"Real Horovod against dtrun's adapter, 2 ranks on localhost, {args.real_rounds} "
            f"alternating jobs per engine; torch threads per rank: {threads}; load average "
            f"{load0[0]:.2f} before, {load1[0]:.2f} after (1 min)")
    table = ["| variant | median | |", "|---|---:|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = head + "\n\n" + "\n".join(table) + "\n"
    print(text)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "horovod-real.md").write_text(text)
    (OUT_DIR / "horovod-real.json").write_text(json.dumps(
        {"mlp_step_s": mlp, "img_per_s": img, "threads": probe, "commands": cmd,
         "loadavg": [load0, load1]}, indent=1))


# ----------------------------------------------------------------------------- driver
def run_job(kind: str, args) -> dict:
    return run_bench_job("bench_horovod", ["-np", "2", "-H", "localhost:2"],
                         [str(Path(__file__).resolve()), "--worker", kind, *timing_argv(args)],
                         timeout=1200)


def peers_comparison(args) -> None:
    """collectives.horovod against dp, DDP and MultiWorkerMirroredStrategy (one job each)."""
    t = run_job("torch", args)["rounds"]
    tfdoc = run_job("tf", args)
    med = {m: statistics.median(v) for m, v in t.items()}
    tmed = {m: statistics.median(v) for m, v in tfdoc["rounds"].items()}
    ms = lambda s: f"{1000 * s:.1f}"  # noqa: E731
    # hvd and dp run the same optimizer: compare them round by round (the load on a
    # shared machine drifts between rounds more than between two neighbouring variants).
    slower = statistics.median(h / d for h, d in zip(t["hvd"], t["dp"])) - 1
    rows = [
        ("dtrun.collectives.horovod.torch DistributedOptimizer", ms(med["hvd"]),
         f"{slower:+.1%} against collectives.dp (median of per-round ratios)"),
        ("dtrun.collectives.dp DistributedOptimizer", ms(med["dp"]), ""),
        ("torch DDP, gloo", ms(med["ddp"]), f"hvd gives {med['ddp'] / med['hvd']:.2f}x DDP's speed"),
        ("Keras 3 train_on_batch, collectives.horovod.keras DistributedOptimizer",
         ms(tmed["hvd-fit"]), ""),
        ("TF GradientTape step in tf.function, collectives.horovod.tensorflow "
         "DistributedGradientTape", ms(tmed["hvd-tape"]), ""),
    ]
    if "mwms-tape" in tmed:
        rows.append(("the same step under tf.distribute.MultiWorkerMirroredStrategy",
                     ms(tmed["mwms-tape"]),
                     f"hvd gives {tmed['mwms-tape'] / tmed['hvd-tape']:.2f}x its speed"))
    else:
        rows.append(("the same step under tf.distribute.MultiWorkerMirroredStrategy", "-",
                     f"did not start: {tfdoc['skipped']}"))
    head = (f"MLP 256-{'-'.join([str(WIDTH)] * DEPTH)}-10, batch {BATCH} per rank, SGD with "
            f"momentum, 2 ranks on localhost, 1 compute thread per rank; median step time over "
            f"{args.rounds} alternating rounds of {args.steps} steps")
    write_table("horovod", head, rows,
                {"torch_median_s": med, "tf_median_s": tmed, "torch_rounds": t, "tf": tfdoc})
    print(f"goal hvd at most 2 % slower than dp: {'met' if slower <= 0.02 else 'MISSED'} "
          f"({slower:+.1%})")


def main() -> int:
    ap = argparse.ArgumentParser(description="dtrun.collectives.horovod against dp, DDP, TF's "
                                 "MultiWorkerMirroredStrategy and real Horovod, 2 ranks")
    ap.add_argument("--worker", choices=["torch", "tf", "hvd-mlp", "probe"], help=argparse.SUPPRESS)
    add_timing_args(ap, rounds=7)
    ap.add_argument("--real-horovod", metavar="PYTHON", default=os.environ.get("BENCH_REAL_HOROVOD"),
                    help="the Python of an environment with Horovod 0.28.1 built (horovodrun "
                    "beside it); also $BENCH_REAL_HOROVOD")
    ap.add_argument("--horovod-examples", metavar="DIR", help="a Horovod checkout, for "
                    "examples/pytorch/pytorch_synthetic_benchmark.py (needs torchvision)")
    ap.add_argument("--model", default="resnet18", help="torchvision model of the synthetic "
                    "benchmark (default resnet18)")
    ap.add_argument("--batch-size", type=int, default=8, help="synthetic benchmark's batch per rank")
    ap.add_argument("--real-rounds", type=int, default=5, help="jobs per engine, alternating")
    ap.add_argument("--only-real", action="store_true", help="only the real-Horovod comparison")
    args = ap.parse_args()
    workers = {"torch": torch_worker, "tf": tf_worker, "hvd-mlp": hvd_mlp_worker,
               "probe": lambda a: thread_probe()}
    if args.worker:
        workers[args.worker](args)
        return 0
    if not args.only_real:
        peers_comparison(args)
    real_comparison(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
