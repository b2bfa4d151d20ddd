"""Which sample goes to which rank, and when.

Training: one global permutation per epoch (seeded by ``seed + epoch``), cut
into global micro-batches of ``global_batch`` samples; rank r takes slice
``[r*b, (r+1)*b)`` of each. So the job sees the same global batches in the same
order whatever the world size, ranks are disjoint, and no sample is ever
duplicated to pad a rank (torch's DistributedSampler pads by repeating samples,
which also biases metrics). Samples that do not fill a whole optimizer step
(``global_batch * grad_accum_steps``) are dropped for that epoch; the
permutation changes each epoch, so every sample is still used.

``order="bijection"`` (a token file's windows, ``TokenWindows.sample_order``): the same global batches, the
epoch's order computed a micro-batch at a time by :class:`~ddplab.data.bijection.IndexBijection` instead of
held as a permutation: constant memory per rank, however many samples.

Validation: contiguous shards of sizes differing by at most one, no padding;
metrics are reduced as sums, so every sample counts exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

from ddplab.data.bijection import IndexBijection

ORDERS = ("permutation", "bijection")
_BLOCK = 16384  # indices the bijection order computes at a time (a few hundred KB, whatever the dataset)


class ShardedGlobalSampler(Sampler[int]):
    """Drop-in for DistributedSampler (has ``set_epoch``), yielding this rank's indices."""

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        world_size: int,
        rank: int,
        seed: int,
        grad_accum_steps: int = 1,
        shuffle: bool = True,
        order: str = "permutation",
    ):
        if order not in ORDERS:
            raise ValueError(f"sample order {order!r}: one of {ORDERS}")
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {world_size}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.order = order if shuffle else "permutation"
        self.per_rank_batch = global_batch // world_size
        self.steps_per_epoch = num_samples // (global_batch * grad_accum_steps)
        self.num_micro_batches = self.steps_per_epoch * grad_accum_steps
        self.epoch = 0
        self.skip = 0  # micro-batches of this epoch already consumed (mid-epoch resume)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch's permutation; ``skip`` resumes after that many micro-batches."""
        self.epoch, self.skip = epoch, skip

    def batches(self) -> Tensor:
        """(num_micro_batches, per_rank_batch) indices for this rank and epoch (held whole: the indexed
        path's, for data in memory)."""
        if self.order == "bijection":
            rows = (
                np.arange(self.num_micro_batches)[:, None] * self.global_batch
                + self.rank * self.per_rank_batch
            )
            order = IndexBijection(self.num_samples, self.seed + self.epoch)
            return torch.from_numpy(
                order((rows + np.arange(self.per_rank_batch)).ravel()).reshape(rows.shape[0], -1)
            )
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            perm = torch.randperm(self.num_samples, generator=g)
        else:
            perm = torch.arange(self.num_samples)
        used = perm[: self.num_micro_batches * self.global_batch]
        return used.view(self.num_micro_batches, self.world_size, self.per_rank_batch)[:, self.rank]

    def __iter__(self) -> Iterator[int]:
        if self.order == "bijection":  # indices computed a block of micro-batches at a time: bounded memory
            order = IndexBijection(self.num_samples, self.seed + self.epoch)
            mine = np.arange(self.per_rank_batch) + self.rank * self.per_rank_batch
            block = max(1, _BLOCK // self.per_rank_batch)  # numpy's per-call cost spread over ~16k indices
            for first in range(self.skip, self.num_micro_batches, block):
                mbs = np.arange(first, min(first + block, self.num_micro_batches))[:, None]
                yield from order((mbs * self.global_batch + mine).ravel()).tolist()
            return
        # A micro-batch at a time: a whole epoch as one Python list costs ~60 bytes per sample, which
        # grows with a token file far past the permutation's own 8 bytes per window. One host read of the
        # index tensor, here at the epoch's start (a zero-copy numpy view); none inside the steps.
        rows = self.batches()[self.skip :].numpy()
        for row in rows:
            yield from row.tolist()

    def __len__(self) -> int:
        return self.num_micro_batches * self.per_rank_batch


def eval_span(num_samples: int, world_size: int, rank: int) -> range:
    """This rank's validation indices as a range: contiguous, no padding, sizes differ by <= 1. A range, not
    an index per sample: a token file's validation windows run to millions."""
    q, r = divmod(num_samples, world_size)  # torch.tensor_split's cut
    start = rank * q + min(rank, r)
    return range(start, start + q + (rank < r))


def eval_shard(num_samples: int, world_size: int, rank: int) -> Tensor:
    """:func:`eval_span` as an index tensor (in-memory data is indexed with it)."""
    span = eval_span(num_samples, world_size, rank)
    return torch.arange(span.start, span.stop)
