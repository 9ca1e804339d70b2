"""Data-parallel training of a small CNN on an MNIST-like task, with collectives.dp.

The data is made here (nothing is downloaded): 10 classes of 16x16 images, each a
fixed random stroke pattern, shifted by up to a pixel and covered in noise. The
global batch is the same for any number of ranks (each rank takes BATCH / size rows
of it), so 1 rank and 4 ranks follow the same trajectory and reach the same accuracy.

    python examples/train_mnist_like.py                  # 1 rank
    dtrun -np 4 python examples/train_mnist_like.py      # 4 ranks
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import dtrun.collectives.dp as dp

BATCH, CLASSES, SIDE = 64, 10, 16


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy, shifted copies of 10 class prototypes (the prototypes never change)."""
    protos = (torch.rand(CLASSES, SIDE, SIDE, generator=torch.Generator().manual_seed(0)) > 0.75).float()
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = protos[y]
    shifts = torch.randint(-1, 2, (n, 2), generator=g)
    x = torch.stack([torch.roll(img, (int(a), int(b)), dims=(0, 1)) for img, (a, b) in zip(x, shifts)])
    x = x + 0.5 * torch.randn(x.shape, generator=g)
    return x.unsqueeze(1), y


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = torch.nn.Linear(16 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--train", type=int, default=2048, help="training images")
    ap.add_argument("--lr", type=float, default=0.003)
    args = ap.parse_args()
    torch.set_num_threads(1)

    ctx = dp.init()                                     # rank, size, local_rank, device
    if BATCH % ctx.size:
        raise SystemExit(f"the global batch {BATCH} must divide over {ctx.size} ranks")
    torch.manual_seed(ctx.rank)                         # ranks start different ...
    model = Net().to(ctx.device)
    dp.broadcast_parameters(model, root=0)              # ... and now hold rank 0's weights
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    opt = dp.DistributedOptimizer(opt, named_parameters=model.named_parameters())

    x, y = make_data(args.train, seed=1)
    x_test, y_test = make_data(1000, seed=2)
    per_rank = BATCH // ctx.size
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(args.train, generator=torch.Generator().manual_seed(epoch))
        losses = []
        for i in range(0, args.train - BATCH + 1, BATCH):
            # This rank's rows of the global batch (every rank shuffles alike).
            idx = order[i + ctx.rank * per_rank:i + (ctx.rank + 1) * per_rank]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx].to(ctx.device)), y[idx].to(ctx.device))
            loss.backward()
            opt.step()                                  # gradients averaged over ranks
            losses.append(loss.item())
        # Test accuracy: each rank scores its shard of the test set; average the counts.
        mine = dp.shard(len(y_test), shuffle=False, even=False)
        with torch.no_grad():
            pred = model(x_test[mine].to(ctx.device)).argmax(1).cpu()
        correct = dp.allreduce_metric(float((pred == y_test[mine]).sum()), op="sum")
        loss = dp.allreduce_metric(sum(losses) / len(losses))
        if ctx.rank == 0:
            print(f"epoch {epoch + 1}: loss {loss:.4f}, test accuracy "
                  f"{100 * correct / len(y_test):.1f}% ({ctx.size} rank{'s' if ctx.size > 1 else ''}, "
                  f"{time.perf_counter() - start:.1f} s)", flush=True)
    if ctx.rank == 0:
        print(f"final test accuracy {100 * correct / len(y_test):.1f}%")


if __name__ == "__main__":
    main()
