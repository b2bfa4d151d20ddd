"""Iterables of (x, y) batches on the training device, one per rank."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from ddplab.data.datasets import TensorData
from ddplab.data.sampling import ShardedGlobalSampler, eval_shard


class TrainLoader:
    """This rank's micro-batches for one epoch; ``set_epoch`` reshuffles.

    In-memory ``TensorData`` is indexed a whole batch at a time (no per-sample
    ``__getitem__`` + collate); any other Dataset goes through a DataLoader
    driven by the same sampler.
    """

    def __init__(self, data: Dataset, sampler: ShardedGlobalSampler, device: torch.device, num_workers: int = 0):
        self.data, self.sampler, self.device = data, sampler, device
        self._loader = None
        if not isinstance(data, TensorData):
            self._loader = DataLoader(
                data, batch_size=sampler.per_rank_batch, sampler=sampler, num_workers=num_workers,
                pin_memory=device.type == "cuda", persistent_workers=num_workers > 0,
            )

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip)

    def __len__(self) -> int:
        return self.sampler.num_micro_batches

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        nb = self.device.type == "cuda"  # async host->device copy; a no-op flag on CPU
        if self._loader is not None:
            for x, y in self._loader:
                yield x.to(self.device, non_blocking=nb), y.to(self.device, non_blocking=nb)
            return
        for idx in self.sampler.batches()[self.sampler.skip:]:
            yield self.data.x[idx].to(self.device, non_blocking=nb), self.data.y[idx].to(self.device, non_blocking=nb)


def eval_batches(data: Dataset, world_size: int, rank: int, batch_size: int,
                 device: torch.device) -> Iterator[tuple[Tensor, Tensor]]:
    """This rank's exact validation shard (every sample on exactly one rank)."""
    shard = eval_shard(len(data), world_size, rank)
    nb = device.type == "cuda"
    if isinstance(data, TensorData):
        for idx in shard.split(batch_size):
            yield data.x[idx].to(device, non_blocking=nb), data.y[idx].to(device, non_blocking=nb)
        return
    for x, y in DataLoader(Subset(data, shard.tolist()), batch_size=batch_size):
        yield x.to(device, non_blocking=nb), y.to(device, non_blocking=nb)
