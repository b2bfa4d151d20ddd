"""Iterable datasets (any ``torch.utils.data.IterableDataset``), read as ONE global stream.

Every rank reads the same stream through torchdata's ``StatefulDataLoader``, cuts it into global
micro-batches of ``batch_size`` samples and keeps its slice ``[r*b, (r+1)*b)``: the rule ddplab's
map-style sampler follows, so the promises carry over:

* the same global batches at any world size (world sizes 1/2/3 give the same metrics, fp32);
* ranks disjoint, each sample the stream yields used once per epoch (the tail that does not fill an
  optimizer step is left, as with map-style data);
* every rank runs the same number of steps: there is one stream, so no rank runs dry before another;
* the loader's state (its workers' too) is the checkpoint entry ``data``: a mid-epoch resume continues
  at the next unread sample, at this world size or another, bitwise at the same one.

The price: every rank reads the whole stream (it collates only its slice). That is cheap beside a training step for
token or feature streams; decoding-heavy streams are better as map-style datasets (``imagefolder``).

What the dataset must do (docs/data-at-scale.md): have ``__len__`` (samples per epoch: the schedule's
length), give the same stream for the same ``set_epoch(epoch)`` (called when defined), and with
``perf.num_workers`` > 0 split its stream over the workers (``torch.utils.data.get_worker_info``). With
``state_dict()``/``load_state_dict()`` a resume restores it directly; without, the loader replays the
stream up to the position (exact, but it rereads).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from ddplab.data.batches import move
from ddplab.data.sampling import ShardedGlobalSampler, eval_shard


class StreamEnded(RuntimeError):
    """The stream yielded fewer samples than its ``__len__`` promised (the same on every rank)."""


def is_stream(data: Any) -> bool:
    return isinstance(data, IterableDataset)


class StreamLoader:
    """This rank's micro-batches of an iterable dataset for one epoch; the TrainLoader of streams."""

    def __init__(self, data: IterableDataset, sampler: ShardedGlobalSampler, device: torch.device,
                 num_workers: int = 0, pin_memory: bool = True, collate_fn: Callable[[list[Any]], Any] | None = None,
                 prefetch_factor: int = 2, worker_init_fn: Callable[[int], None] | None = None):
        self.data, self.sampler, self.device = data, sampler, device
        self.num_workers, self.prefetch, self.worker_init_fn = num_workers, prefetch_factor, worker_init_fn
        self.collate = collate_fn or default_collate  # this rank's slice only: nobody collates the whole batch
        self.pin = pin_memory and device.type == "cuda"
        self._loader: Any = None
        self._epoch, self._served = 0, 0  # micro-batches of this epoch handed out
        self._saved: dict[str, Any] | None = None  # a checkpoint's loader state, for the next __iter__

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip)

    def describe(self) -> str:
        return (f"a stream ({type(self.data).__name__}, {self.num_workers} worker(s)): every rank reads it and "
                "keeps its slice of each global batch")

    def __len__(self) -> int:
        return self.sampler.num_micro_batches

    def _fresh_loader(self) -> Any:
        import warnings

        from torchdata.stateful_dataloader import StatefulDataLoader

        # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates: a warning per epoch, not ours to fix.
        warnings.filterwarnings("ignore", message=".*'set_vital' is deprecated", category=UserWarning)
        # Samples, not batches, from the workers: torch batches an IterableDataset per worker, so each worker
        # would drop its own tail and the epoch would depend on num_workers. Its own generator: a loader draws
        # a seed per iterator, which would otherwise come from the global RNG and shift dropout's stream.
        workers = self.num_workers
        ahead = max(1, self.prefetch * self.sampler.global_batch // workers) if workers else None  # samples each
        return StatefulDataLoader(self.data, batch_size=None, num_workers=workers, prefetch_factor=ahead,
                                  worker_init_fn=self.worker_init_fn if workers else None,
                                  generator=torch.Generator().manual_seed(self.sampler.seed * 1_000_003 + 7))

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self.sampler.epoch, self.sampler.skip
        if hasattr(self.data, "set_epoch"):
            self.data.set_epoch(epoch)
        loader, saved, self._saved = self._fresh_loader(), self._saved, None
        if skip:  # a mid-epoch resume: the checkpoint holds the loader's state at exactly this point
            if saved is None or (saved["epoch"], saved["micro_batches"]) != (epoch, skip):
                raise RuntimeError(f"resume: no saved stream position for epoch {epoch}, micro-batch {skip} (the "
                                   f"checkpoint has {None if saved is None else (saved['epoch'], saved['micro_batches'])})")
            loader.load_state_dict(saved["loader"])
        self._loader, self._epoch, self._served = loader, epoch, skip
        b, promised = self.sampler.per_rank_batch, self.sampler.num_micro_batches
        lo, samples = self.sampler.rank * b, iter(loader)
        while self._served < promised:  # the tail that does not fill an optimizer step stays unread
            group = list(itertools.islice(samples, self.sampler.global_batch))
            if len(group) < self.sampler.global_batch:
                break
            self._served += 1  # before the yield: a checkpoint taken while this batch trains counts it
            yield move(self.collate(group[lo:lo + b]), self.device, self.pin)
        if self._served == promised:
            return
        raise StreamEnded(f"{type(self.data).__name__} ended after {self._served} global batches of "
                          f"{self.sampler.global_batch} in epoch {epoch + 1}, but its __len__ ({self.sampler.num_samples}) "
                          f"promises {promised}. Fix: make __len__ the number of samples one epoch yields")

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint entry ``data``: where this epoch's stream is, the loader's (and workers') state."""
        state = self._loader.state_dict() if self._loader is not None else None
        return {"epoch": self._epoch, "micro_batches": self._served, "loader": state}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._saved = sd if sd.get("loader") is not None else None


def stream_eval_batches(data: IterableDataset, world_size: int, rank: int, batch_size: int, device: torch.device,
                        collate_fn: Callable[[list[Any]], Any] | None = None) -> Iterator[Any]:
    """This rank's validation shard of a stream: the same contiguous cut as map-style data (by position in
    the stream, which ``__len__`` sizes), every sample on exactly one rank."""
    collate = collate_fn or default_collate
    shard = eval_shard(len(data), world_size, rank)
    start, stop = (int(shard[0]), int(shard[-1]) + 1) if len(shard) else (0, 0)
    nb, buf = device.type == "cuda", []
    for i, sample in enumerate(data):
        if i >= stop:
            break
        if i >= start:
            buf.append(sample)
        if len(buf) == batch_size:
            yield move(collate(buf), device, nb)
            buf = []
    if buf:
        yield move(collate(buf), device, nb)
