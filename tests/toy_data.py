"""tests/toy.py's datasets and streams: slow on one rank, ragged batches, noise from a generator no
checkpoint holds (or from torch's, which one does), IterableDatasets with and without state, streams that
differ between ranks. Named by `_target_=toy.X` (toy.py re-exports them)."""

import time

import torch
from toy_models import _rank

from ddplab.data import Splits, synthetic


class _Slow(torch.utils.data.Dataset):
    def __init__(self, data, delay_s: float, rank: int):
        self.data, self.delay = data, delay_s if _rank() == rank else 0.0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return self.data[i]


def slow_synthetic(delay_s: float = 0.002, slow_rank: int = 1, **kw) -> Splits:
    """synthetic() served through a DataLoader, with per-sample delay on one rank."""
    s = synthetic(**kw)
    return Splits(_Slow(s.train, delay_s, slow_rank), s.val, s.num_classes)


def ragged_digits(**kw):
    """digits whose collate function drops one label: a batch whose tensors disagree on their length."""
    from ddplab.data import digits

    s = digits(**kw)

    def collate(samples):
        return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])[:-1]

    return {"train": s.train, "val": s.val, "collate_fn": collate}


class _Noisy(torch.utils.data.Dataset):
    """Samples plus noise from a numpy generator of the dataset's own, which no checkpoint holds."""

    def __init__(self, base, seed):
        import numpy as np

        self.base, self.rng = base, np.random.default_rng(seed)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + torch.from_numpy(self.rng.normal(0.0, 0.5, tuple(x.shape)).astype("float32")), y


def noisy_digits(noise_seed=None, **kw):
    """digits with per-sample noise: ``noise_seed=None``, an unseeded generator (no two runs alike); a
    seed, the same noise each run, but after a resume the generator starts again from that seed."""
    from ddplab.data import digits

    s = digits(**kw)
    return {"train": _Noisy(s.train, noise_seed), "val": s.val}


class _TorchNoisy(torch.utils.data.Dataset):
    """Samples plus noise drawn from torch's global generator (what the docs tell users to do: ddplab seeds
    and checkpoints it)."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.5 * torch.randn(x.shape), y


def torch_noisy_digits(**kw):
    """digits with per-sample noise from torch's global generator."""
    from ddplab.data import digits

    s = digits(**kw)
    return {"train": _TorchNoisy(s.train), "val": s.val}


class DigitStream(torch.utils.data.IterableDataset):
    """An IterableDataset over the digits: one order per (seed, epoch), split over DataLoader workers. It has
    no state_dict(): torchdata replays it on resume. ``short_on_rank``: that rank's stream ends ``short``
    samples early (a user's rank-dependent stream)."""

    def __init__(self, x, y, seed=0, short_on_rank=None, short=0):
        self.x, self.y, self.seed, self.epoch, self.pos = x, y, seed, 0, 0
        self.short_on_rank, self.short = short_on_rank, short

    def set_epoch(self, epoch):
        self.epoch, self.pos = epoch, 0

    def __len__(self):
        return len(self.y)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, nw = (info.id, info.num_workers) if info else (0, 1)
        order = torch.randperm(
            len(self.y), generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        )
        if self.short_on_rank is not None and _rank() == self.short_on_rank:
            order = order[: len(order) - self.short]
        mine = order[w::nw]
        while self.pos < len(mine):
            i = int(mine[self.pos])
            self.pos += 1
            yield self.x[i], self.y[i]


class StatefulDigitStream(DigitStream):
    """The same stream with its position as state: torchdata restores it (in each worker) instead of
    replaying."""

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd):
        self.epoch, self.pos = sd["epoch"], sd["pos"]


class UnevenDigitStream(StatefulDigitStream):
    """Worker 1's share is the first ``short`` samples, worker 0's the rest: one worker's stream ends long
    before the other's (a folder whose files differ in size, split by file over the workers)."""

    def __init__(self, x, y, short=10):
        super().__init__(x, y)
        self.short_share = short

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        mine = range(self.short_share) if info and info.id == 1 else range(self.short_share, len(self.y))
        while self.pos < len(mine):
            i = mine[self.pos]
            self.pos += 1
            yield self.x[i], self.y[i]


def digit_stream(stateful=True, short_on_rank=None, short=0, **kw):
    """digits' training set as a (Stateful)DigitStream; validation a stream too, in stored order."""
    from ddplab.data import digits

    s = digits(**kw)
    cls = StatefulDigitStream if stateful else DigitStream
    return {
        "train": cls(s.train.x, s.train.y, kw.get("split_seed", 0), short_on_rank, short),
        "val": ValStream(s.val.x, s.val.y),
    }


class ValStream(torch.utils.data.IterableDataset):
    """Validation samples as a stream in their stored order."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __iter__(self):
        return zip(self.x, self.y)


class RankDependentStream(torch.utils.data.IterableDataset):
    """A user's stream that is not the same on every rank. ``how="shards_itself"``: it yields only its rank's
    share (torch.distributed.get_rank(), what datasets' split_dataset_by_node does), its __len__ that share's;
    ``how="python_shuffle"``: each epoch's order from Python's global random, which ddplab seeds per rank."""

    def __init__(self, x, y, how):
        self.x, self.y, self.how = x, y, how

    def _share(self):
        import torch.distributed as dist

        on = self.how == "shards_itself" and dist.is_initialized()
        return (dist.get_rank(), dist.get_world_size()) if on else (0, 1)

    def __len__(self):
        rank, world = self._share()
        return len(range(rank, len(self.y), world))

    def __iter__(self):
        import random

        order = list(range(len(self.y)))
        if self.how == "python_shuffle":
            random.shuffle(order)
        rank, world = self._share()
        for i in order[rank::world]:
            yield self.x[i], self.y[i]


def rank_dependent_stream(how, **kw):
    """digits' training set as a RankDependentStream; validation a stream in stored order."""
    from ddplab.data import digits

    s = digits(**kw)
    return {"train": RankDependentStream(s.train.x, s.train.y, how), "val": ValStream(s.val.x, s.val.y)}
