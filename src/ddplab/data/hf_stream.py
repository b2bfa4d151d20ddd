"""``dataset=hf dataset.streaming=true``: local files read row by row through ``datasets``' streaming mode, in
constant memory, as ONE global stream that ddplab shards (ddplab.data.streams).

The samples are those of the in-memory source (ddplab.data.hf) with one difference: windows never cross a
file's end (each file's ids are joined and cut on their own), so the set of samples does not depend on how
many loader workers read the files (with ``perf.num_workers`` = W, worker w reads files w, w+W, ...; one file:
the samples are exactly the in-memory source's). The order is the files' order (no shuffle: shuffle the rows
when the files are written); with workers, the loader takes one sample from each in turn.

A resume continues mid-file: the state is the file, ``datasets``' own position in it (``state_dict``) before
the last read of rows, the tokens left over before that read (fewer than a window) and how many of its samples
were taken; the resume redoes that one read (a few hundred rows), so the state a loader worker sends with each
sample stays a few hundred bytes. ``__len__`` (the samples an epoch yields: the lr schedule's length) is
counted by one pass at start-up, or given as ``dataset.num_samples``."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ddplab.data import counts
from ddplab.errors import InputError

log = logging.getLogger(__name__)
ROWS_PER_READ = 256  # rows tokenized together (one batch call): the state is saved between reads


def open_datasets() -> Any:
    """Hugging Face ``datasets``, quiet and offline for local files (the hf extra's absence: one line)."""
    try:
        import datasets
    except ImportError:
        raise InputError(
            "dataset=hf needs Hugging Face datasets, which is not installed. Fix: pip install 'ddplab[hf]'"
        ) from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    # Each load_dataset would otherwise send a HEAD request to the Hub (its download counter; 3 s timeout):
    # a network call for local files, and 3 s per file opened where there is no network.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


def null_said(column: str, key: str, split: str, file: str, row: int) -> str:
    """The one line for a row with no value in the column a sample is made of."""
    return (
        f"dataset.{split}: {file} row {row} has no value (null) in column '{column}' (dataset.{key}). Fix: "
        "drop "
        "or fill the rows without one when the file is written"
    )


def row_in_files(files: list[str], fmt: str, row: int) -> tuple[str, int]:
    """Which file, and which of its rows, global ``row`` of the files read in order is (counts rows: an error
    path only)."""
    for f in files:
        n = open_datasets().load_dataset(fmt, data_files=[f], split="train").num_rows
        if row < n:
            return Path(f).name, row
        row -= n
    return "the data", row


def _first_columns(file: str, fmt: str) -> list[str]:
    rows = open_datasets().load_dataset(fmt, data_files=[file], split="train", streaming=True)
    return sorted(next(iter(rows), {}).keys())


def columns_apart(files: list[str], fmt: str) -> str | None:
    """Which file's columns differ from the first file's, said; None where they all agree."""
    first = _first_columns(files[0], fmt)
    for f in files[1:]:
        cols = _first_columns(f, fmt)
        if cols != first:
            return f"{Path(f).name} has columns {cols}, {Path(files[0]).name} has {first}"
    return None


def tokenizer_for(tokenizer: str | None, key: str) -> Any:
    """The local tokenizer a text column ``dataset.<key>`` is encoded with."""
    if tokenizer is None:
        raise InputError(
            f"dataset.{key} is a text column, so it needs dataset.tokenizer=<a local tokenizer.json>"
            " (scripts/make_tokens.py --train-bpe writes one). Fix: set dataset.tokenizer"
        )
    from ddplab.data.tokenizer import load

    return load(tokenizer)


class HFStream(IterableDataset):
    """Samples of ``files`` (one format): LM windows of ``x`` (``y`` None) or one labelled row each."""

    def __init__(
        self,
        files: list[str],
        fmt: str,
        x: str,
        y: str | None,
        tokenizer: str | None,
        block_size: int,
        vocab_size: int,
        pad_id: int,
        num_samples: int | None,
        key: str,
    ):
        self.files, self.fmt, self.x, self.y, self.key = files, fmt, x, y, key
        self.tokenizer, self.block_size, self.vocab_size, self.pad_id = (
            tokenizer,
            block_size,
            vocab_size,
            pad_id,
        )
        self._where: tuple[int, Any, list[Any], int] | None = None  # file, rows' state, carry, at (see _file)
        self._resume: dict[str, Any] | None = None
        self._tok: Any = None
        self._read = 0
        if num_samples is not None:
            counts.check(self._source(), files, num_samples, key)
        self.num_samples = num_samples if num_samples is not None else self._count()

    def __len__(self) -> int:
        return self.num_samples

    @property
    def length_fix(self) -> str:
        """The fix ddplab's stream loader names when an epoch yields fewer samples than ``__len__`` says."""
        return f"drop dataset.num_samples={self.num_samples} (the samples are then counted at start-up)"

    def __getstate__(self) -> dict[str, Any]:  # to the loader's workers: no tokenizer, no open file
        return {**self.__dict__, "_tok": None, "_where": None}

    def state_dict(self) -> dict[str, Any]:
        if self._where is None:
            return {}
        file, rows, carry, at = self._where
        return {"file": file, "rows": copy.deepcopy(rows), "carry": list(carry), "at": at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = copy.deepcopy(state) if state else None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # Not a generator itself: the position is reset when the iterator is made, before its first sample.
        resume, self._resume = self._resume, None
        self._where = (
            None if resume is None else (resume["file"], resume["rows"], resume["carry"], resume["at"])
        )
        return self._samples(resume)

    def _samples(self, resume: dict[str, Any] | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        mine = range(info.id, len(self.files), info.num_workers) if info else range(len(self.files))
        for i in mine:
            if resume is not None and i < resume["file"]:
                continue
            here, resume = (resume if resume is not None and i == resume["file"] else None), None
            yield from self._file(i, here)
        self._where = (len(self.files), None, [], 0)  # done: a resume reads nothing more this epoch

    def _file(self, i: int, resume: dict[str, Any] | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """File ``i``'s samples, from a saved position: the rows' state before a read, what was left uncut
        before it (under a window), and how far into that read's samples it was (the read is redone: a small
        state)."""
        rows, before, carry, skip = self._rows(self.files[i]), None, [], 0
        # rows of this file read so far (a resumed read counts from its position: said roughly)
        self._read = 0
        if resume is not None:
            before, carry, skip = resume["rows"], list(resume["carry"]), resume["at"]
            if before is not None:
                rows.load_state_dict(before)
        need, step = (1, 1) if self.y is not None else (self.block_size + 1, self.block_size)
        # Batches of rows through .iter: iterating the dataset itself inside a loader worker would let
        # datasets split the (one-file) dataset over the workers once more, and all but one would read
        # nothing.
        for batch in rows.iter(batch_size=ROWS_PER_READ):
            pending, at, skip = carry + self._encode(batch, i), skip, 0
            while len(pending) - at >= need:
                sample, at = self._sample(pending, at), at + step
                self._where = (i, before, carry, at)  # what a checkpoint taken after this sample resumes from
                yield sample
            carry, before = pending[at:], copy.deepcopy(rows.state_dict())

    def _sample(self, pending: list[Any], at: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.y is not None:
            return pending[at]
        # Windows overlap by one token: the last target is the next window's first input.
        w = torch.tensor(pending[at : at + self.block_size + 1], dtype=torch.int64)
        return w[:-1], w[1:]

    def _encode(self, batch: dict[str, list[Any]], i: int = 0) -> list[Any]:
        """A read's rows (columns of lists) of file ``i``: LM: their ids joined; labelled: one (x, y) per
        row."""
        for key, name in (("x", self.x), ("y", self.y)):
            if name is not None and name not in batch:
                if i:  # the first file has it: the files disagree, and another column would break the others
                    raise InputError(
                        f"dataset.{self.key}: {Path(self.files[i]).name} has no column '{name}' "
                        f"(dataset.{key}); it has {sorted(batch)}. Fix: give every file of one split "
                        f"the same columns"
                    )
                raise InputError(
                    f"dataset.{key}={name}: no such column; {Path(self.files[i]).name} has "
                    f"{sorted(batch)}. Fix: dataset.{key}=<one of them>"
                )
            empty = (
                next((r for r, v in enumerate(batch.get(name) or []) if v is None), None) if name else None
            )
            if empty is not None:
                raise InputError(null_said(name, key, self.key, Path(self.files[i]).name, self._read + empty))
        self._read += len(batch[self.x])
        col = batch[self.x]
        if not col:
            return []
        ids = self._ids(col) if isinstance(col[0], str) or self.y is None else None
        if self.y is None:
            flat = [t for r in ids for t in r]
            if flat and max(flat) >= self.vocab_size:
                raise InputError(
                    f"dataset.{self.key}: token id {max(flat)} >= dataset.vocab_size={self.vocab_size}. "
                    f"Fix: dataset.vocab_size=<the tokenizer's vocabulary>"
                )
            return flat
        b = self.block_size
        xs = (
            [torch.tensor(s[:b] + [self.pad_id] * (b - len(s[:b])), dtype=torch.int64) for s in ids]
            if ids is not None
            else [torch.as_tensor(v, dtype=torch.float32) for v in col]
        )
        ys = [torch.as_tensor(v) for v in batch[self.y]]
        return [(x, y.long() if not y.is_floating_point() else y.float()) for x, y in zip(xs, ys)]

    def _ids(self, col: list[Any]) -> list[list[int]]:
        if not isinstance(col[0], str):
            return [list(map(int, r)) for r in col]
        if self._tok is None:
            self._tok = tokenizer_for(self.tokenizer, "x")
        return [e.ids for e in self._tok.encode_batch(col, add_special_tokens=False)]

    def _rows(self, file: str) -> Any:
        return open_datasets().load_dataset(self.fmt, data_files=[file], split="train", streaming=True)

    def _count(self) -> int:
        """One pass over every file: the samples an epoch yields (windows per file, or rows)."""
        t0, n = time.perf_counter(), 0
        for i, file in enumerate(self.files):
            tokens, self._read = 0, 0
            for batch in self._rows(file).iter(batch_size=ROWS_PER_READ):
                if self.y is not None:
                    n += len(batch[self.y])
                else:
                    tokens += len(self._encode(batch, i))
            n += max(0, tokens - 1) // self.block_size
        log.info(
            "dataset.%s: %d samples in %d file(s), counted in %.1fs (dataset.num_samples=%d skips the count; "
            "checked against these files)",
            self.key,
            n,
            len(self.files),
            time.perf_counter() - t0,
            n,
        )
        counts.record(self._source(), self.files, n)
        return n

    def _source(self) -> dict[str, Any]:
        """What decides the count besides the files: how they are read and cut."""
        return {
            "key": self.key,
            "dirs": sorted({str(Path(f).resolve().parent) for f in self.files}),
            "fmt": self.fmt,
            "x": self.x,
            "y": self.y,
            "tokenizer": self.tokenizer,
            "block_size": self.block_size,
        }
