"""Shared by tests/unit/test_streams.py and tests/integration/test_streams.py."""

from __future__ import annotations

import torch
import toy

from ddplab.data.sampling import ShardedGlobalSampler
from ddplab.data.streams import StreamLoader

STREAM = ["model=mlp", "dataset._target_=toy.digit_stream", "progress=none", "batch_size=48"]


def stream(n: int = 100, stateful: bool = True) -> toy.DigitStream:
    x = torch.arange(n, dtype=torch.float32)[:, None]  # sample i is the value i: easy to track
    return (toy.StatefulDigitStream if stateful else toy.DigitStream)(x, torch.arange(n), seed=1)


def ids(batches) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def loader(data, world: int, rank: int, workers: int = 0, global_batch: int = 12) -> StreamLoader:
    return StreamLoader(
        data,
        ShardedGlobalSampler(len(data), global_batch, world, rank, 0),
        torch.device("cpu"),
        num_workers=workers,
    )
