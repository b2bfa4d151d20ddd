"""Samples/s of a stream read through loader workers: the rank's side of ``perf.num_workers`` on an iterable
dataset (ddplab.data.streams). A worker's samples reach the rank by value (``_by_value``: numpy bytes through
the loader's queue) instead of torch's shared memory and a file descriptor per tensor.

    python scripts/bench_stream_workers.py            # the digits as a stream, 1 rank, global batch 48
    python scripts/bench_stream_workers.py --shm      # the same, each sample's tensors as torch sends them
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ddplab.data import digits, streams
from ddplab.data.sampling import ShardedGlobalSampler


class Digits(IterableDataset):
    """The digits' training set in stored order, split over the workers (a row of one tensor each sample)."""

    def __init__(self):
        self.x, self.y = (lambda s: (s.x, s.y))(digits().train)

    def __len__(self):
        return len(self.y)

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        return ((self.x[i], self.y[i]) for i in range(w, len(self.y), n))


def epoch_seconds(workers: int) -> float:
    data = Digits()
    loader = streams.StreamLoader(
        data, ShardedGlobalSampler(len(data), 48, 1, 0, 0), torch.device("cpu"), num_workers=workers
    )
    loader.set_epoch(0)
    t0 = time.perf_counter()
    sum(1 for _ in loader)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shm", action="store_true", help="torch's own transfer of the workers' tensors")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    n = len(Digits())
    shm = mock.patch.object(streams, "_by_value", torch.utils.data.default_convert)
    with shm if args.shm else contextlib.nullcontext():
        for workers in (0, 2):
            took = statistics.median(epoch_seconds(workers) for _ in range(args.repeats))
            print(
                f"workers={workers} {'shm' if args.shm else 'by value'}: {n / took:,.0f} samples/s "
                f"({took:.2f} s an epoch of {n}, median of {args.repeats})"
            )


if __name__ == "__main__":
    main()
