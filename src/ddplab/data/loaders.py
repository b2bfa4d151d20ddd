"""Iterables of batches on the training device, one per rank: (x, y) pairs from tensors, or
whatever a dataset's samples (and its collate function) make — tuples, dicts, nested."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ddplab.data.augment import BatchAugment, PerSampleAugment
from ddplab.data.batches import move
from ddplab.data.datasets import TensorData
from ddplab.data.sampling import ShardedGlobalSampler, eval_shard, eval_span
from ddplab.data.streams import is_stream, stream_eval_batches


def on_device(data: Dataset, device: torch.device, mode: str) -> bool:
    """Whether ``data`` should live on ``device`` and be indexed a batch at a time (perf.data_on_device)."""
    mode = str(mode).lower()
    if mode == "false" or not isinstance(data, TensorData):
        return False
    if mode == "true" or device.type != "cuda":
        return True  # on CPU the tensors are in memory already
    size = data.x.element_size() * data.x.numel() + data.y.element_size() * data.y.numel()
    free, _ = torch.cuda.mem_get_info(device)
    return size < free // 4  # leave the rest for activations


def to_device(data: TensorData, device: torch.device) -> TensorData:
    return TensorData(data.x.to(device), data.y.to(device))


class TrainLoader:
    """This rank's micro-batches for one epoch; ``set_epoch`` reshuffles.

    ``TensorData`` already on the training device (perf.data_on_device) is
    indexed a whole batch at a time and augmented as a batch on the device:
    no per-sample ``__getitem__``, no collate, no host-to-device copy per
    step. Anything else goes through a DataLoader driven by the same sampler
    (per-sample augmentation in its workers, pinned memory, async copies).
    """

    def __init__(
        self,
        data: Dataset,
        sampler: ShardedGlobalSampler,
        device: torch.device,
        augment: BatchAugment | None = None,
        num_workers: int = 0,
        pin_memory: bool = True,
        indexed: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefetch_factor: int = 2,
        worker_init_fn: Callable[[int], None] | None = None,
        starting_workers: Callable[[], ContextManager[None]] = contextlib.nullcontext,
    ):
        """``indexed``: batch ``data`` (a TensorData on ``device``) by index; None: whenever it can.
        ``collate_fn``: the dataset's own, for the DataLoader path; ``prefetch_factor``: batches each worker
        keeps ready; ``worker_init_fn``: run in each worker as it starts; ``starting_workers``: the context
        the workers are forked in (ddplab.runtime.signals.WorkerShield.starting)."""
        self.data, self.sampler, self.device = data, sampler, device
        self.starting_workers = starting_workers
        self.augment = augment if augment is not None and augment.enabled else None
        self._loader = None
        can_index = isinstance(data, TensorData) and data.x.device == device
        if indexed and not can_index:
            raise ValueError("indexed batching needs a TensorData already on the training device")
        self.indexed = can_index if indexed is None else indexed
        if not self.indexed:
            source = PerSampleAugment(data, self.augment) if self.augment else data
            self._loader = DataLoader(
                source,
                batch_size=sampler.per_rank_batch,
                sampler=sampler,
                num_workers=num_workers,
                collate_fn=collate_fn,
                pin_memory=pin_memory and device.type == "cuda",
                persistent_workers=num_workers > 0,
                prefetch_factor=prefetch_factor if num_workers > 0 else None,
                worker_init_fn=worker_init_fn,
                # Its own generator: the loader draws a seed per epoch, which would
                # otherwise come from the global RNG and shift dropout's stream.
                generator=torch.Generator().manual_seed(sampler.seed * 1_000_003 + sampler.rank),
            )

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip)

    def describe(self) -> str:
        aug = f", {self.augment}" if self.augment else ""
        if self.indexed:
            return f"in memory on {self.device}, batched by index{aug}"
        return f"DataLoader, {self._loader.num_workers} worker(s), per-sample{aug}"

    def __len__(self) -> int:
        return self.sampler.num_micro_batches

    def __iter__(self) -> Iterator[Any]:
        if self._loader is not None:
            nb = self._loader.pin_memory  # async host->device copy out of pinned memory
            with self.starting_workers():  # the first iterator forks the (persistent) workers
                batches = iter(self._loader)
            for batch in batches:
                yield move(batch, self.device, nb)
            return
        # One host->device copy of the epoch's indices, then pure device indexing.
        idx = self.sampler.batches()[self.sampler.skip :].to(self.device)
        for i in idx:
            x = self.data.x[i]
            yield (self.augment(x) if self.augment else x), self.data.y[i]


def eval_batches(
    data: Dataset,
    world_size: int,
    rank: int,
    batch_size: int,
    device: torch.device,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Iterator[Any]:
    """This rank's exact validation shard (every sample on exactly one rank)."""
    if is_stream(data):
        yield from stream_eval_batches(data, world_size, rank, batch_size, device, collate_fn)
        return
    nb = device.type == "cuda"
    if isinstance(data, TensorData):
        for idx in eval_shard(len(data), world_size, rank).to(data.x.device).split(batch_size):
            if not len(idx):  # an empty shard splits into one empty chunk: no batch at all
                continue
            yield data.x[idx].to(device, non_blocking=nb), data.y[idx].to(device, non_blocking=nb)
        return
    # The shard is contiguous: a range, not a list of every index (a token file's windows run to millions).
    for batch in DataLoader(
        Subset(data, eval_span(len(data), world_size, rank)),
        batch_size=batch_size,
        pin_memory=nb,
        collate_fn=collate_fn,
    ):
        yield move(batch, device, nb)
