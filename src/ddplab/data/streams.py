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

So the stream must be the same on every rank: the first global batch each process reads is checked (a hash per
sample, ONE small collective) and a stream that differs (one that shards itself by rank, or shuffles with a
generator ddplab seeds per rank) is refused in one line rather than losing or doubling samples without a word.

The price: every rank reads the whole stream (it collates only its slice). That is cheap beside a training
step for token or feature streams; decoding-heavy streams are better as map-style datasets (``imagefolder``).

What the dataset must do (docs/data-at-scale.md): have ``__len__`` (samples per epoch: the schedule's
length), give the same stream for the same ``set_epoch(epoch)`` (called when defined), and with
``perf.num_workers`` > 0 split its stream over the workers (``torch.utils.data.get_worker_info``). With
``state_dict()``/``load_state_dict()`` a resume restores it directly; without, the loader replays the
stream up to the position (exact, but it rereads).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

import torch
from torch import Tensor
from torch.utils.data import IterableDataset, default_collate, default_convert

from ddplab import compat
from ddplab.data.batches import move
from ddplab.data.sampling import ShardedGlobalSampler, eval_span
from ddplab.errors import ConfigError


class StreamEnded(RuntimeError):
    """The stream yielded fewer samples than its ``__len__`` promised (the same on every rank)."""


def is_stream(data: Any) -> bool:
    return isinstance(data, IterableDataset)


class StreamLoader:
    """This rank's micro-batches of an iterable dataset for one epoch; the TrainLoader of streams."""

    def __init__(
        self,
        data: IterableDataset,
        sampler: ShardedGlobalSampler,
        device: torch.device,
        num_workers: int = 0,
        pin_memory: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefetch_factor: int = 2,
        worker_init_fn: Callable[[int], None] | None = None,
        all_ranks_rows: Callable[[Tensor], Tensor] | None = None,
        name: str | None = None,
        starting_workers: Callable[[], ContextManager[None]] = contextlib.nullcontext,
    ):
        """``all_ranks_rows``: every rank's row of a tensor (one collective), for checking once that the ranks
        read the same stream; None on one rank. ``name``: the dataset as the user's config names it.
        ``starting_workers``: the context each epoch's workers are forked in (see TrainLoader)."""
        self.starting_workers = starting_workers
        self.data, self.sampler, self.device = data, sampler, device
        self.all_ranks_rows, self.name = all_ranks_rows, name or type(data).__name__
        self._checked = all_ranks_rows is None  # once per process: the ranks read one stream
        self.num_workers, self.prefetch, self.worker_init_fn = num_workers, prefetch_factor, worker_init_fn
        # this rank's slice only: nobody collates the whole batch
        self.collate = collate_fn or default_collate
        self.pin = pin_memory and device.type == "cuda"
        self._loader: Any = None
        self._epoch, self._served = 0, 0  # micro-batches of this epoch handed out
        self._saved: dict[str, Any] | None = None  # a checkpoint's loader state, for the next __iter__

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip)

    def describe(self) -> str:
        checked = " (checked: the same stream on every rank)" if self.all_ranks_rows is not None else ""
        return (
            f"a stream ({type(self.data).__name__}, {self.num_workers} worker(s)), sharded by ddplab: every "
            "rank "
            f"reads the whole stream and keeps its slice of each global batch{checked}"
        )

    def __len__(self) -> int:
        return self.sampler.num_micro_batches

    def _fresh_loader(self) -> Any:
        import warnings

        from torchdata.stateful_dataloader import StatefulDataLoader

        # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates: a warning per epoch, not ours to
        # fix.
        warnings.filterwarnings("ignore", message=".*'set_vital' is deprecated", category=UserWarning)
        # Samples, not batches, from the workers: torch batches an IterableDataset per worker, so each worker
        # would drop its own tail and the epoch would depend on num_workers. Its own generator: a loader draws
        # a seed per iterator, which would otherwise come from the global RNG and shift dropout's stream.
        workers = self.num_workers
        # samples each
        ahead = max(1, self.prefetch * self.sampler.global_batch // workers) if workers else None
        return StatefulDataLoader(
            self.data,
            batch_size=None,
            num_workers=workers,
            prefetch_factor=ahead,
            collate_fn=_by_value if workers else None,
            worker_init_fn=self.worker_init_fn if workers else None,
            generator=torch.Generator().manual_seed(self.sampler.seed * 1_000_003 + 7),
        )

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self.sampler.epoch, self.sampler.skip
        if hasattr(self.data, "set_epoch"):
            self.data.set_epoch(epoch)
        loader, saved, self._saved = self._fresh_loader(), self._saved, None
        if skip:  # a mid-epoch resume: the checkpoint holds the loader's state at exactly this point
            if saved is None or (saved["epoch"], saved["micro_batches"]) != (epoch, skip):
                raise RuntimeError(
                    f"resume: no saved stream position for epoch {epoch}, micro-batch {skip} (the "
                    f"checkpoint has {None if saved is None else (saved['epoch'], saved['micro_batches'])})"
                )
            self._check_same_workers(saved["loader"], epoch, skip)
            loader.load_state_dict(saved["loader"])
        self._loader, self._epoch, self._served = loader, epoch, skip
        b, promised = self.sampler.per_rank_batch, self.sampler.num_micro_batches
        with self.starting_workers():
            lo, samples = self.sampler.rank * b, iter(loader)
        if self.num_workers:
            samples = map(_unwrapped, samples)
        while self._served < promised:  # the tail that does not fill an optimizer step stays unread
            group = list(itertools.islice(samples, self.sampler.global_batch))
            if not self._checked:  # before a short group leaves the loop: every rank joins the collective
                self._check_one_stream(group)
            if len(group) < self.sampler.global_batch:
                break
            self._served += 1  # before the yield: a checkpoint taken while this batch trains counts it
            yield move(self.collate(group[lo : lo + b]), self.device, self.pin)
        if self._served == promised:
            return
        fix = getattr(self.data, "length_fix", "make __len__ the number of samples one epoch yields")
        raise StreamEnded(
            f"{type(self.data).__name__} ended after {self._served} global batches of "
            f"{self.sampler.global_batch} in epoch {epoch + 1}, but its __len__ ({self.sampler.num_samples}) "
            f"promises {promised}. Fix: {fix}"
        )

    def _check_same_workers(self, state: dict[str, Any], epoch: int, skip: int) -> None:
        """A mid-epoch position holds only with the loader workers it was saved with."""
        old = compat.loader_workers(state)
        if old != self.num_workers:
            raise ConfigError(
                f"perf.num_workers={self.num_workers}: the checkpoint stopped mid-epoch (epoch {epoch + 1}, "
                "micro-batch "
                f"{skip}) in a stream read with perf.num_workers={old}; the order in which workers hand over "
                "samples "
                f"is part of the stream, so that position means other samples with {self.num_workers}. Fix: "
                "resume "
                f"with perf.num_workers={old} (change it at an epoch's end)"
            )

    def _check_one_stream(self, group: list[Any]) -> None:
        """Every rank must read the same samples in the same order; the first global batch read tells."""
        self._checked = True
        ids = [sample_id(x) for x in group]
        row = torch.zeros(self.sampler.global_batch + 1, dtype=torch.int64)
        row[0], row[1 : len(ids) + 1] = len(ids), torch.tensor(ids, dtype=torch.int64)
        rows = self.all_ranks_rows(row.to(self.device)).cpu()
        other = next((r for r in range(1, len(rows)) if not torch.equal(rows[r], rows[0])), None)
        if other is not None:
            raise ConfigError(stream_differs(self.name, rows[0], rows[other], other))

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint entry ``data``: where this epoch's stream is, the loader's (and workers') state."""
        state = compat.stream_state(self._loader.state_dict()) if self._loader is not None else None
        return {"epoch": self._epoch, "micro_batches": self._served, "loader": state}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._saved = sd if sd.get("loader") is not None else None


# Dtypes numpy holds exactly: a worker's tensor of one of these crosses to the rank by value (pickled bytes).
_NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)


class _ByValue:
    """A worker's CPU tensor as a numpy array: sent whole through the loader's queue. torch sends a tensor by
    moving its storage to shared memory and passing a file descriptor per sample (a row of a dataset tensor
    moves the whole dataset's storage), ~1.5 ms a sample on the 2-core VM: 5x the time of the bytes."""

    __slots__ = ("array",)

    def __init__(self, array: Any):
        self.array = array


def _by_value(sample: Any) -> Any:
    """In a loader worker: torch's per-sample conversion (numpy arrays become tensors, as without this), then
    each plain CPU tensor wrapped as its numpy array; other tensors (bfloat16, ...) go as torch sends them."""

    def wrap(x: Any) -> Any:
        if isinstance(x, Tensor):
            plain = (
                x.device.type == "cpu"
                and x.layout == torch.strided
                and not x.requires_grad
                and not x.is_conj()
                and not x.is_neg()
            )  # lazy views numpy() refuses
            return _ByValue(x.numpy()) if plain and x.dtype in _NUMPY_DTYPES else x
        if isinstance(x, dict):
            return {k: wrap(v) for k, v in x.items()}
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*(wrap(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(wrap(v) for v in x)
        return x

    return wrap(default_convert(sample))


def _unwrapped(sample: Any) -> Any:
    """On the rank: the tensors the worker wrapped (``_by_value``), the same bytes and dtype."""
    if isinstance(sample, _ByValue):
        return torch.from_numpy(sample.array)
    if isinstance(sample, dict):
        return {k: _unwrapped(v) for k, v in sample.items()}
    if isinstance(sample, tuple) and hasattr(sample, "_fields"):
        return type(sample)(*(_unwrapped(v) for v in sample))
    if isinstance(sample, (list, tuple)):
        return type(sample)(_unwrapped(v) for v in sample)
    return sample


def sample_id(sample: Any) -> int:
    """A 64-bit hash of a sample that is the same in every process for the same data: tensors and arrays
    (numpy, PIL images: anything with ``tobytes``) by type, shape and bytes; strings and bytes as they are;
    numbers by repr; an object whose repr is only its address (``<Foo at 0x7f...>``, different in each
    process) by its type."""
    h = hashlib.blake2b(digest_size=8)

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            h.update(f"{t.dtype}{tuple(x.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k, v in x.items():
                h.update(repr(k).encode())
                feed(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                feed(v)
        elif isinstance(x, (str, bytes)):
            h.update(x.encode() if isinstance(x, str) else x)
        # numpy arrays, PIL images: their repr elides or is an address
        elif callable(getattr(x, "tobytes", None)):
            shape = getattr(x, "shape", None) or getattr(x, "size", None)
            h.update(f"{type(x).__name__}{getattr(x, 'dtype', getattr(x, 'mode', ''))}{shape}".encode())
            h.update(x.tobytes())
        else:
            text = repr(x)
            h.update((type(x).__qualname__ if " at 0x" in text else text).encode())

    feed(sample)
    return int.from_bytes(h.digest(), "little", signed=True)


def stream_differs(name: str, first: Tensor, other: Tensor, rank: int) -> str:
    """The one line that refuses a stream which differs between rank 0 and ``rank`` (rows: count, ids...)."""
    n0, n1 = int(first[0]), int(other[0])
    a, b = set(first[1 : n0 + 1].tolist()), set(other[1 : n1 + 1].tolist())
    shuffle = (
        "shuffles with a generator that differs between ranks (Python's random or numpy's global generator, "
        "which ddplab seeds per rank, or an unseeded one)"
    )
    if a == b and n0 == n1:
        what, fix = (
            f"the same samples in another order: it {shuffle}",
            ("shuffle with a generator of your own seeded from the seed and set_epoch's epoch alone"),
        )
    else:
        common = "none" if not a & b else f"{len(a & b)} of {n0}"
        what = (
            f"{n1} samples where rank 0 has {n0}" if n0 != n1 else f"other samples ({common} in common)"
        ) + (
            ": it shards itself by rank (torch.distributed.get_rank(), datasets' split_dataset_by_node), "
            "which ddplab "
            f"then shards again, or {shuffle}"
        )
        fix = (
            "yield the whole stream on every rank, in an order seeded from the seed and set_epoch's epoch "
            "alone, "
            "and let ddplab give each rank its slice"
        )
    return (
        f"{name}: the training stream is not the same on every rank, so samples would be lost or used twice: "
        "its "
        f"first global batch read has, on rank {rank}, {what}. Fix: {fix}"
    )


def stream_eval_batches(
    data: IterableDataset,
    world_size: int,
    rank: int,
    batch_size: int,
    device: torch.device,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Iterator[Any]:
    """This rank's validation shard of a stream: the same contiguous cut as map-style data (by position in
    the stream, which ``__len__`` sizes), every sample on exactly one rank."""
    collate = collate_fn or default_collate
    span = eval_span(len(data), world_size, rank)
    start, stop = span.start, span.stop
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
