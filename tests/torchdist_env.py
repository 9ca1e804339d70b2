"""A script written for torchrun, run unchanged under dtrun (tests/test_torchdist.py).

It only uses torch.distributed's env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), trains one DistributedDataParallel step with gloo (or ``nccl`` given as
the argument, each rank on GPU LOCAL_RANK) and prints
``RESULT {json}`` per rank.
"""
import gc
import json
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

backend = sys.argv[1] if len(sys.argv) > 1 else "gloo"  # or nccl (one GPU per rank)
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=60))
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)], device=dev)
dist.all_reduce(t)
torch.manual_seed(rank)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2).to(dev))
model(torch.full((3, 4), float(rank), device=dev)).sum().backward()
grad = model.module.weight.grad.sum().item()
print("RESULT " + json.dumps({
    "rank": rank, "size": size, "sum": t.item(), "grad": grad, "host": socket.gethostname(),
    "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                           "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")},
}), flush=True)
del model  # DDP's reducer holds the process group: release it first
dist.barrier()  # no rank tears gloo down while a peer still talks to it
dist.destroy_process_group()
# Free what gloo's finished work still references now, not during interpreter shutdown:
# torch 2.x can abort there ("terminate called without an active exception"); seen in
# 2 of 40 runs under `python -m mpi4py` (dtrun's rank wrapper), 0 of 100 with this line.
gc.collect()
