"""The default job (digits, convnet, SGD + cosine, DDP) written by hand, the way the DDP tutorials do it, for
``scripts/bench_startup.py --vs-hand``: launch to exit against ``train.py`` doing the same.

    python scripts/_hand_default_job.py --steps 1 --out DIR
    torchrun --standalone --nproc_per_node=2 scripts/_hand_default_job.py --steps 1 --out DIR

It imports and opens what ddplab's job does before its first step: torch, the process group (gloo, under
torchrun), the digits file through the same reader, the same model, a TensorBoard writer on rank 0; then
trains ``--steps`` steps, evaluates once (reduced across ranks), saves a checkpoint on rank 0 and exits.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch
    import torch.distributed as torch_dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.tensorboard import SummaryWriter

    sys.path.insert(0, str(REPO / "src"))
    from ddplab.data.datasets import digits
    from ddplab.models import ConvNet

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        torch_dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = digits()
    model = ConvNet(num_classes=10, in_channels=1)
    ddp = DDP(model) if world > 1 else model
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(a.steps, 1)))
    )
    writer = SummaryWriter(f"{a.out}/tb") if rank == 0 else None
    per_rank = 64 // world
    order = torch.randperm(len(data.train.y), generator=torch.Generator().manual_seed(0))
    ddp.train()
    for step in range(a.steps):
        idx = order[(step * world + rank) * per_rank : (step * world + rank + 1) * per_rank]
        loss = F.cross_entropy(ddp(data.train.x[idx]), data.train.y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    reduced = loss.detach().clone()
    if world > 1:
        torch_dist.all_reduce(reduced)
    sums = _evaluate(model, data, rank, world)
    if writer is not None:
        writer.add_scalar("train/loss", reduced.item() / world, a.steps)
        writer.add_scalar("val/loss", (sums[0] / sums[2]).item(), a.steps)
        writer.add_scalar("val/acc", (sums[1] / sums[2]).item(), a.steps)
        writer.close()
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
            f"{a.out}/last.pt",
        )
    if world > 1:
        # Without it rank 1, done first, tore its gloo group down while rank 0 was still writing: gloo aborted
        # it ("terminate called without an active exception", SIGABRT) in about 1 launch in 10.
        torch_dist.barrier()
        torch_dist.destroy_process_group()


def _evaluate(model, data, rank: int, world: int):
    """The validation loss sum, correct count and sample count over every rank's shard."""
    import torch
    import torch.distributed as torch_dist
    import torch.nn.functional as F

    model.eval()
    with torch.no_grad():
        mine = torch.arange(rank, len(data.val.y), world)
        logits = model(data.val.x[mine])
        sums = torch.stack(
            [
                F.cross_entropy(logits, data.val.y[mine], reduction="sum"),
                (logits.argmax(1) == data.val.y[mine]).sum().float(),
                torch.tensor(float(len(mine))),
            ]
        )
    if world > 1:
        torch_dist.all_reduce(sums)
    return sums


if __name__ == "__main__":
    main()
