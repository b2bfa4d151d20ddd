"""The hand-written side of scripts/bench_overhead.py: the DDP loop a careful user writes by hand today (a
DistributedSampler, DDP, an optimizer, a cosine schedule, TensorBoard on rank 0, exact evaluation)."""

from __future__ import annotations

import argparse
import math
import os


class HandLoop:
    """What a careful user writes by hand today (one ``epoch()`` at a time)."""

    def __init__(self, a: argparse.Namespace, init_process_group: bool):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
        from torch.utils.tensorboard import SummaryWriter

        from ddplab.data import synthetic  # the same tensors ddplab's dataset=synthetic makes

        self.a = a
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0))
        cuda = a.device == "cuda"
        self.device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        if self.world > 1 and init_process_group:
            dist.init_process_group("nccl" if cuda else "gloo")

        torch.manual_seed(0)
        data = synthetic(num_train=a.num_train, num_val=a.num_val, in_channels=3, image_size=a.image_size)
        model = _model(a)
        self.fmt = torch.channels_last if a.channels_last else torch.contiguous_format
        self.model = model.to(self.device).to(memory_format=self.fmt)
        self.ddp = DDP(self.model, device_ids=[local] if cuda else None) if self.world > 1 else self.model
        self.per_rank = a.batch_size // self.world
        total = a.num_train // a.batch_size * a.epochs
        self.opt = torch.optim.SGD(
            self.ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True
        )
        warm = min(20, total - 1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda s: (
                (s + 1) / warm
                if s < warm
                else 0.5 * (1 + math.cos(math.pi * min((s - warm) / max(total - warm, 1), 1.0)))
            ),
        )
        self.dtype = torch.bfloat16 if (not cuda or torch.cuda.is_bf16_supported()) else torch.float16
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=a.amp and self.dtype == torch.float16)
        self.writer = SummaryWriter(f"{a.workdir}/hand/tb") if self.rank == 0 else None

        train_set = TensorDataset(data.train.x, data.train.y)
        self.sampler = DistributedSampler(
            train_set, self.world, self.rank, shuffle=True, seed=0, drop_last=True
        )
        self.loader = DataLoader(
            train_set, batch_size=self.per_rank, sampler=self.sampler, drop_last=True, pin_memory=cuda
        )
        self.xs, self.ys = data.train.x.to(self.device), data.train.y.to(self.device)  # "tensor" path
        val_set = TensorDataset(data.val.x, data.val.y)
        self.val_loader = DataLoader(
            val_set, batch_size=256, sampler=DistributedSampler(val_set, self.world, self.rank, shuffle=False)
        )
        self.step = self.epochs_done = 0

    def reduce_tensor(self, t):
        import torch.distributed as dist

        if self.world == 1:
            return t
        rt = t.clone()
        dist.all_reduce(rt)
        return rt / self.world

    def batches(self):
        import torch

        if self.a.hand_data == "loader":
            for x, y in self.loader:
                yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        else:
            for idx in torch.tensor(list(self.sampler)).to(self.device).split(self.per_rank):
                if len(idx) == self.per_rank:
                    yield self.xs[idx], self.ys[idx]

    def epoch(self) -> None:
        for _ in self.train_steps():
            pass
        self.evaluate_and_save()

    def all_steps(self, epochs: int):
        """Every step of ``epochs`` epochs, one per ``next()``; an epoch's evaluation and checkpoint run
        in the call after its last step (the step-paired benchmark drives the loop this way)."""
        for _ in range(epochs):
            yield from self.train_steps()
            self.evaluate_and_save()

    def train_steps(self):
        """One epoch's training steps, yielding after each."""
        import torch
        import torch.nn.functional as F

        dev = self.device
        self.sampler.set_epoch(self.epochs_done)
        self.ddp.train()
        for x, y in self.batches():
            x = x.contiguous(memory_format=self.fmt)
            with torch.autocast(dev.type, dtype=self.dtype, enabled=self.a.amp):
                loss = F.cross_entropy(self.ddp(x), y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            self.sched.step()
            self.step += 1
            if self.step % 10 == 0:
                reduced = self.reduce_tensor(loss.detach())
                if self.writer:
                    self.writer.add_scalar("train/loss", reduced.item(), self.step)
            yield

    def evaluate_and_save(self) -> None:
        """The epoch's evaluation, reduced across ranks, and rank 0's checkpoint."""
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        dev = self.device
        self.ddp.eval()
        sums = torch.zeros(3, device=dev, dtype=torch.float64)
        with torch.no_grad():
            for x, y in self.val_loader:
                x, y = x.to(dev).contiguous(memory_format=self.fmt), y.to(dev)
                with torch.autocast(dev.type, dtype=self.dtype, enabled=self.a.amp):
                    logits = self.model(x)
                sums += torch.stack(
                    [
                        F.cross_entropy(logits.float(), y, reduction="sum").double(),
                        (logits.argmax(1) == y).sum().double(),
                        torch.tensor(len(y), device=dev),
                    ]
                )
        if self.world > 1:
            dist.all_reduce(sums)
        if self.rank == 0:
            self.writer.add_scalar("val/loss", (sums[0] / sums[2]).item(), self.step)
            self.writer.add_scalar("val/acc", (sums[1] / sums[2]).item(), self.step)
            torch.save(
                {
                    "model": self.model.state_dict(),
                    "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(),
                    "scaler": self.scaler.state_dict(),
                    "epoch": self.epochs_done,
                },
                f"{self.a.workdir}/hand/ckpt.pt",
            )
        self.epochs_done += 1

    def close(self) -> None:
        import torch.distributed as dist

        if self.writer:
            self.writer.close()
        if self.world > 1 and dist.is_initialized():
            dist.barrier()


def _model(a: argparse.Namespace):
    """The model ddplab's ``model=`` builds for the same job (its classes, the same arguments)."""
    from ddplab.models import MLP, ConvNet, resnet18

    if a.model == "convnet":
        return ConvNet(num_classes=10, in_channels=3)
    if a.model == "mlp":  # the overhead-bound path: a step of ~1 ms, most of it the loop's own
        return MLP(num_classes=10, in_channels=3, image_size=a.image_size)
    return resnet18(num_classes=10, in_channels=3, small_input=a.image_size < 64)
