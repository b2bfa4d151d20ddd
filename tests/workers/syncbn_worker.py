"""Run under torchrun: GlobalBatchNorm on per-rank shards == BatchNorm on the whole batch.

Rank 0 prints the max abs difference of outputs, input gradients, parameter
gradients (after DDP-style averaging) and running statistics.
"""

import json

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from ddplab.runtime import group
from ddplab.syncbn import convert_sync_batchnorm

state = group.init(
    OmegaConf.create({"device": "cpu", "backend": "gloo", "init_method": "env://", "timeout_s": 60})
)
W, r = state.world_size, state.rank
torch.manual_seed(0)
per_rank = [5, 3, 4][:W]  # unequal shards on purpose
x_all = torch.randn(sum(per_rank), 3, 4, 4, dtype=torch.float64) * 3 + 1
target = torch.randn(sum(per_rank), 3, 4, 4, dtype=torch.float64)
ref = nn.Sequential(nn.BatchNorm2d(3)).double()
ref[0].weight.data.uniform_(0.5, 1.5)
ref[0].bias.data.uniform_(-1, 1)
mine = convert_sync_batchnorm(ref.__class__(nn.BatchNorm2d(3)).double(), state.device)
mine.load_state_dict(ref.state_dict())

lo, hi = sum(per_rank[:r]), sum(per_rank[: r + 1])
xr = x_all[lo:hi].clone().requires_grad_(True)
out = mine(xr)
# Global-mean loss: the sum of rank losses equals the single-process loss.
loss = ((out - target[lo:hi]) ** 2).sum() / x_all.numel()
loss.backward()
grads = torch.cat([mine[0].weight.grad, mine[0].bias.grad])
dist.all_reduce(grads)  # what DDP's gradient all-reduce does (sum; the loss is already global)


def gather(t):  # gloo's all_gather wants equal sizes: pad to the largest shard
    m = max(per_rank)
    padded = torch.zeros(m, *t.shape[1:], dtype=t.dtype)
    padded[: len(t)] = t
    parts = [torch.zeros_like(padded) for _ in range(W)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, per_rank)])


outs, xgrads = gather(out.detach()), gather(xr.grad)

xa = x_all.clone().requires_grad_(True)
ref_out = ref(xa)
((ref_out - target) ** 2).sum().div(x_all.numel()).backward()
ref_grads = torch.cat([ref[0].weight.grad, ref[0].bias.grad])
if r == 0:
    print(
        "RESULT "
        + json.dumps(
            {
                "type": type(mine[0]).__name__,
                "out": (outs - ref_out).abs().max().item(),
                "xgrad": (xgrads - xa.grad).abs().max().item(),
                "pgrad": (grads - ref_grads).abs().max().item(),
                "rmean": (mine[0].running_mean - ref[0].running_mean).abs().max().item(),
                "rvar": (mine[0].running_var - ref[0].running_var).abs().max().item(),
            }
        ),
        flush=True,
    )
group.teardown()
