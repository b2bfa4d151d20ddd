"""SyncBatchNorm that also works on CPU (gloo).

``torch.nn.SyncBatchNorm`` refuses non-CUDA modules, so on CPU ddplab swaps
each BatchNorm for :class:`GlobalBatchNorm`: batch statistics over the whole
global batch, computed from per-rank (count, mean, centred sum of squares)
merged with the parallel-variance formula — one differentiable collective per
layer per training forward. On CUDA torch's own fused SyncBatchNorm is used.
State-dict keys are unchanged either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddplab import compat


class _AllReduceSum(torch.autograd.Function):
    """all_reduce(SUM) whose backward all-reduces the gradient: every rank's
    loss depends on every rank's contribution to the global statistics."""

    @staticmethod
    def forward(ctx, t: Tensor) -> Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class GlobalBatchNorm(compat.BatchNormBase):
    """BatchNorm{1,2,3}d whose training statistics span every rank's batch."""

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D)")

    def forward(self, x: Tensor) -> Tensor:
        if not (
            self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        ):
            return super().forward(x)
        c = x.size(1)
        dims = [0, *range(2, x.dim())]
        shape = [1, c] + [1] * (x.dim() - 2)
        # Statistics in fp32 even for half inputs (as torch's BN does); fp64 stays fp64.
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        n = torch.full((1,), x.numel() // c, dtype=xf.dtype, device=x.device)
        mean_i = xf.mean(dims)
        m2_i = (xf - mean_i.view(shape)).pow(2).sum(dims)
        world, rank = dist.get_world_size(), dist.get_rank()
        rows = torch.zeros(world, 1 + 2 * c, dtype=xf.dtype, device=x.device)
        rows[rank] = torch.cat([n, mean_i, m2_i])
        # Differentiable: the backward all-reduces each rank's gradient w.r.t.
        # the statistics back to the ranks that produced them.
        rows = _AllReduceSum.apply(rows)
        counts, means, m2s = rows[:, :1], rows[:, 1 : 1 + c], rows[:, 1 + c :]
        total = counts.sum()
        mean = (counts * means).sum(0) / total
        var = (m2s.sum(0) + (counts * (means - mean).pow(2)).sum(0)) / total  # biased, for normalising
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), m)
                unbiased = var * total / (total - 1).clamp(min=1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), m)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """torch's SyncBatchNorm on CUDA; :class:`GlobalBatchNorm` elsewhere (same keys, same state)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _swap(module)


def _swap(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, compat.BatchNormBase) and not isinstance(module, GlobalBatchNorm):
        out = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        with torch.no_grad():
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
            if module.track_running_stats:
                out.running_mean, out.running_var = module.running_mean, module.running_var
                out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, _swap(child))
    return out
