"""Token files bigger than memory: a flat binary of token ids (nanoGPT's ``train.bin`` / ``val.bin``
layout: uint16 or uint32, no header), read a window at a time.

Window ``i`` is tokens ``[i*B, i*B + B]`` (``B`` = ``block_size``): inputs are its first ``B`` tokens,
targets the last ``B``. Windows do not overlap, so an epoch is a fixed, finite set of samples and
ddplab's sampler gives it the same guarantees as any map-style dataset: every window once per epoch
across ranks, the same global batches at any world size, and a mid-epoch resume that skips exactly
what was consumed.

Windows are read with ``os.pread``, not through ``np.memmap``: pages of a mapped file that a
process has touched count towards its resident memory (and a job's memory limit) until the kernel
reclaims them, so a memory-mapped epoch over a 10 GB file shows up as 10 GB of RSS. A read leaves
them in the page cache, which no process is charged for. ``scripts/bench_tokens.py`` measures both.

``write_tokens`` writes a file and a small sidecar (``<file>.json``: dtype, token count,
vocabulary size); when the sidecar is there, a run whose ``dataset.dtype`` differs, or a file whose
length no longer matches it (truncated, appended), is refused before training starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, IterableDataset, default_collate

from ddplab.data.bijection import IndexBijection
from ddplab.data.datasets import Splits
from ddplab.errors import InputError

DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}


class TokenFileError(InputError):
    """A token file that does not match its config or its sidecar, or that changed under a run."""


def write_tokens(tokens: Any, path: str | Path, dtype: str = "uint16", vocab_size: int | None = None) -> Path:
    """Write ``tokens`` (a sequence of ints) as a flat binary of ``dtype`` plus its sidecar; the path."""
    arr = np.asarray(tokens)
    top = int(arr.max()) if arr.size else 0
    if top > np.iinfo(DTYPES[dtype]).max:
        raise ValueError(f"token {top} does not fit {dtype}. Fix: dtype=uint32")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    arr.astype(DTYPES[dtype]).tofile(tmp)
    os.replace(tmp, path)  # a reader never sees half a file
    write_sidecar(path, dtype, int(arr.size), vocab_size or top + 1)
    return path


def write_sidecar(
    path: str | Path, dtype: str, tokens: int, vocab_size: int, tokenizer: dict[str, Any] | None = None
) -> None:
    """``<path>.json``: what a run checks the file against (dtype, token count, vocabulary size), and the
    tokenizer that wrote it, if not bytes (ddplab.data.tokenizer.describe: its file, hash, vocabulary)."""
    meta = {
        "dtype": dtype,
        "tokens": tokens,
        "vocab_size": vocab_size,
        **({"tokenizer": tokenizer} if tokenizer else {}),
    }
    Path(f"{path}.json").write_text(json.dumps(meta) + "\n")


class TokenWindows(Dataset):
    """Windows ``first .. first+count-1`` of one token file (train and val may share a file)."""

    # The sampler shuffles a token file's windows without a permutation in memory (ddplab.data.bijection):
    # its memory stays flat however big the file.
    sample_order = "bijection"

    def __init__(
        self,
        path: str | Path,
        dtype: str,
        block_size: int,
        vocab_size: int,
        first: int = 0,
        count: int | None = None,
    ):
        self.path, self.dtype, self.block = str(path), DTYPES[dtype], block_size
        self.vocab_size, self.first = vocab_size, first
        self.count = windows_in(self.path, dtype, block_size, vocab_size) - first if count is None else count
        self._fd: int | None = None  # opened in each process that reads (DataLoader workers too)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None}  # a worker opens its own

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.from_numpy(self._checked(np.frombuffer(self._read(i), dtype=self.dtype), [i]))
        return w[:-1], w[1:]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch, as the DataLoader fetches one: every window read, then converted and checked once
        (not per window); contiguous ``(inputs, targets)``, which :func:`collate_windows` passes on."""
        rows = np.frombuffer(b"".join(self._read(i) for i in indices), dtype=self.dtype).reshape(
            len(indices), -1
        )
        w = torch.from_numpy(self._checked(rows, indices))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def _read(self, i: int) -> bytes:
        """Window ``i``'s ``block_size + 1`` tokens, as bytes."""
        if not 0 <= i < self.count:
            raise IndexError(f"window {i} of {self.count}")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        offset, nbytes = self._offset(i), (self.block + 1) * self.dtype.itemsize
        buf = os.pread(self._fd, nbytes, offset)
        if len(buf) != nbytes:
            raise TokenFileError(
                f"{self.path}: truncated: {len(buf)} of {nbytes} bytes at offset {offset}; the file "
                f"is {os.path.getsize(self.path)} bytes now. Fix: do not rewrite a token file a run "
                "is reading; write it again and restart"
            )
        return buf

    def _offset(self, i: int) -> int:
        return (self.first + i) * self.block * self.dtype.itemsize

    def _checked(self, tokens: np.ndarray, indices: list[int]) -> np.ndarray:
        """``tokens`` (one row per window of ``indices``) as int64, every id below the vocabulary size."""
        t = tokens.astype(np.int64)
        top = int(t.argmax())
        row, col = divmod(top, t.shape[-1])
        if t.flat[top] >= self.vocab_size:
            at = self._offset(indices[row]) + col * self.dtype.itemsize
            raise TokenFileError(
                f"{self.path}: token {int(t.flat[top])} at offset {at} is >= "
                f"dataset.vocab_size={self.vocab_size}. Fix: dataset.vocab_size=<your tokenizer's "
                "vocabulary>, or dataset.dtype=<the dtype the file was written with>"
            )
        return t


def collate_windows(batch: Any) -> Any:
    """A batch :meth:`TokenWindows.__getitems__` made is already one: passed on; a list of single windows (a
    wrapper without ``__getitems__``) is stacked as usual."""
    return batch if isinstance(batch, tuple) else default_collate(batch)


def windows_in(path: str, dtype: str, block_size: int, vocab_size: int) -> int:
    """How many whole windows ``path`` holds; refuses a file its sidecar or dtype does not describe."""
    size, item = os.path.getsize(path), DTYPES[dtype].itemsize
    if size % item:
        raise TokenFileError(
            f"{path}: {size} bytes is not a whole number of {dtype} tokens ({item} bytes each). "
            "Fix: dataset.dtype=<the dtype the file was written with>"
        )
    side = Path(f"{path}.json")
    if side.is_file():
        meta = json.loads(side.read_text())
        if meta.get("dtype") != dtype:
            raise TokenFileError(
                f"{path} was written as {meta.get('dtype')} ({side.name}), but dataset.dtype={dtype}. "
                f"Fix: dataset.dtype={meta.get('dtype')}"
            )
        if meta.get("tokens") != size // item:
            raise TokenFileError(
                f"{path}: {size // item} tokens, but {side.name} says {meta.get('tokens')}: the file "
                "was truncated or changed after it was written. Fix: write it again"
            )
        if meta.get("vocab_size", 0) > vocab_size:
            tok = meta.get("tokenizer")
            by = f", written with {tok['file']}: a {tok['model']} of {tok['vocab_size']} ids" if tok else ""
            raise TokenFileError(
                f"{path} holds ids up to {meta['vocab_size'] - 1} ({side.name}{by}), but "
                f"dataset.vocab_size={vocab_size}. Fix: dataset.vocab_size={meta['vocab_size']}"
            )
    return max(0, (size // item - 1) // block_size)


def tokens(
    path: str | None = None,
    val_path: str | None = None,
    dtype: str = "uint16",
    block_size: int = 64,
    vocab_size: int = 256,
    val_fraction: float = 0.1,
) -> Splits:
    """``dataset=tokens``: windows of ``block_size`` from ``path``; validation from ``val_path``, or
    else the last ``val_fraction`` of ``path``'s windows (a contiguous tail, never trained on)."""
    if path is None:
        raise ValueError(
            "dataset.path is not set. Fix: dataset.path=train.bin (scripts/make_tokens.py writes one)"
        )
    if dtype not in DTYPES:
        raise ValueError(
            f"dataset.dtype={dtype}: token files are {' or '.join(DTYPES)}. Fix: dataset.dtype=uint16"
        )
    n = windows_in(path, dtype, block_size, vocab_size)
    if val_path is not None:
        train = TokenWindows(path, dtype, block_size, vocab_size, 0, n)
        val = TokenWindows(val_path, dtype, block_size, vocab_size)
    else:
        k = max(1, round(n * val_fraction))
        train = TokenWindows(path, dtype, block_size, vocab_size, 0, n - k)
        val = TokenWindows(path, dtype, block_size, vocab_size, n - k, k)
    for name, part, file in (("training", train, path), ("validation", val, val_path or path)):
        if len(part) < 1:
            raise ValueError(
                f"{file}: no {name} window of dataset.block_size={block_size} tokens. Fix: a longer "
                "file or a smaller block_size"
            )
    return Splits(train, val, vocab_size, collate_windows)


_CHUNK = 1024  # window indices computed at a time (a few KB)


class TokenShards(IterableDataset):
    """A folder of token files streamed shard by shard (``dataset=token_shards``): each epoch a new shard
    order, within a shard a new window order, each computed as it is read (no permutation in memory). With
    DataLoader workers each takes every ``num_workers``-th shard of the epoch's order. Its position
    (epoch, shard, window) is its ``state_dict``: torchdata's StatefulDataLoader saves it per worker."""

    def __init__(self, files: list[Path], dtype: str, block_size: int, vocab_size: int, seed: int):
        self.shards = [TokenWindows(f, dtype, block_size, vocab_size) for f in files]
        self.seed, self.epoch, self.shard, self.window = seed, 0, 0, 0

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.shard, self.window = epoch, 0, 0

    def _order(self, n: int, salt: int) -> IndexBijection:
        return IndexBijection(n, self.seed * 1_000_003 + self.epoch * 7919 + salt)

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        w, nw = (info.id, info.num_workers) if info else (0, 1)
        mine = self._order(len(self.shards), 0)(np.arange(len(self.shards)))[w::nw].tolist()
        while self.shard < len(mine):
            shard = self.shards[mine[self.shard]]
            # the shard's window order: no permutation held
            order = self._order(len(shard), 1 + mine[self.shard])
            while self.window < len(shard):
                chunk = order(np.arange(self.window, min(self.window + _CHUNK, len(shard)))).tolist()
                for i in chunk:
                    self.window += 1
                    yield shard[i]
            self.shard, self.window = self.shard + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard": self.shard, "window": self.window}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.shard, self.window = sd["epoch"], sd["shard"], sd["window"]


def token_shards(
    path: str | None = None,
    val_path: str | None = None,
    dtype: str = "uint16",
    block_size: int = 64,
    vocab_size: int = 256,
    seed: int = 0,
) -> Splits:
    """``dataset=token_shards``: every ``*.bin`` under the folder ``path``, streamed (:class:`TokenShards`);
    validation: the token file (or every ``*.bin`` of the folder) ``val_path``, read as windows."""
    folder = Path(str(path))
    files = sorted(folder.glob("*.bin"))
    if not files:
        raise ValueError(
            f"dataset.path={path}: no *.bin token files in it. Fix: point it at a folder of token "
            "files (scripts/make_tokens.py --shards N writes one)"
        )
    for f in files:
        windows_in(str(f), dtype, block_size, vocab_size)  # each shard checked against its sidecar up front
    val_files = (
        sorted(Path(str(val_path)).glob("*.bin"))
        if val_path and Path(str(val_path)).is_dir()
        else [Path(str(val_path))]
        if val_path
        else []
    )
    if not val_files:
        raise ValueError(
            f"dataset.val_path={val_path}: no validation token file. Fix: dataset.val_path=<a token "
            "file or a folder of them>"
        )
    val = ConcatDataset([TokenWindows(f, dtype, block_size, vocab_size) for f in val_files])
    return Splits(TokenShards(files, dtype, block_size, vocab_size, seed), val, vocab_size)
