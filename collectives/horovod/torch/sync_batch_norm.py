"""Horovod's ``SyncBatchNorm``: batch normalization over the global batch.

In training the mean and variance are those of every rank's rows together (one
allreduce of per-channel sums, in float64), and the backward pass reduces the two
per-channel sums it needs, so forward and backward equal ``BatchNorm`` on the
concatenated batch. In evaluation, or with one rank, it is plain batch norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .._core import Sum, size
from .grads import allreduce


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    return allreduce(t, op=Sum)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        xd = x.detach().to(torch.float64)
        local_n = x.numel() // x.shape[1]
        stats = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                           torch.tensor([float(local_n)], dtype=torch.float64)])
        stats = _sum_over_ranks(stats.cpu()).to(x.device)
        c = x.shape[1]
        n = stats[-1]
        mean = stats[:c] / n
        var = (stats[c:2 * c] / n - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * n / (n - 1) if n > 1 else var
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype) * momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype) * momentum)
        xhat = (xd - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.detach().to(torch.float64).view(shape) + \
                bias.detach().to(torch.float64).view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.n, ctx.dims, ctx.shape = n, dims, shape
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        xhat, invstd, weight = ctx.saved_tensors
        dims, shape, n = ctx.dims, ctx.shape, ctx.n
        g = gy.to(torch.float64)
        sum_g = g.sum(dims)
        sum_gx = (g * xhat).sum(dims)
        c = sum_g.numel()
        both = _sum_over_ranks(torch.cat([sum_g, sum_gx]).cpu()).to(g.device)
        mean_g, mean_gx = both[:c] / n, both[c:] / n
        w = weight.detach().to(torch.float64) if weight is not None else 1.0
        dx = (g - mean_g.view(shape) - xhat * mean_gx.view(shape)) * \
            (invstd * w).view(shape)
        dweight = sum_gx.to(weight.dtype) if weight is not None else None
        dbias = sum_g.to(weight.dtype) if weight is not None else None
        return dx.to(gy.dtype), dweight, dbias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover every rank's batch (any input rank >= 2)."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        momentum = self.momentum
        if momentum is None:  # cumulative moving average, as torch's BatchNorm
            momentum = 1.0 / float(self.num_batches_tracked)
        if not self.training or size() == 1:
            use_batch = self.training or not self.track_running_stats
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch, momentum, self.eps)
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, self.running_mean,
                                            self.running_var, self.eps, momentum)
