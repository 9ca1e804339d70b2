"""Horovod's PyTorch MNIST example, shape for shape, on dtrun: only the import differs.

    import dtrun.collectives.horovod.torch as hvd     # was: import horovod.torch as hvd

The data is made here (examples/train_mnist_like.py: nothing is downloaded). Each rank
takes its shard of the training set, as Horovod's example does with a DistributedSampler.

    dtrun -np 4 -H localhost:4 python examples/horovod_pytorch_mnist.py
    # Horovod's line was: horovodrun -np 4 -H localhost:4 python pytorch_mnist.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import dtrun.collectives.horovod.torch as hvd
from train_mnist_like import Net, make_data


def metric_average(val: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(val), name=name).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.002)
    ap.add_argument("--fp16-allreduce", action="store_true")
    args = ap.parse_args()

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)

    x, y = make_data(2048, seed=1)
    x_test, y_test = make_data(1000, seed=2)
    train = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.distributed.DistributedSampler(
        train, num_replicas=hvd.size(), rank=hvd.rank())
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    model = Net()
    # Horovod: scale the learning rate by the number of ranks.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average)

    for epoch in range(1, args.epochs + 1):
        model.train()
        sampler.set_epoch(epoch)
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
        model.eval()
        shard = range(hvd.rank(), len(y_test), hvd.size())
        with torch.no_grad():
            out = model(x_test[list(shard)])
        test_loss = metric_average(F.cross_entropy(out, y_test[list(shard)]).item(), "avg_loss")
        test_acc = metric_average((out.argmax(1) == y_test[list(shard)]).float().mean().item(),
                                  "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {100 * test_acc:.1f}%",
                  flush=True)


if __name__ == "__main__":
    main()
