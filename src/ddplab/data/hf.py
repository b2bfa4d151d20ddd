"""Hugging Face ``datasets`` over local files as a ddplab data source (``dataset=hf``; the ``hf`` extra):
Parquet, JSON Lines, CSV or Arrow files, read with ``datasets.load_dataset`` — nothing is downloaded.

Two shapes of batch, by the task:

* ``task=lm``: the ``text`` column tokenized with a local ``tokenizer.json`` (or an ids column used as it
  is), the rows' ids joined and cut into windows of ``block_size`` + 1 — inputs the first ``block_size``,
  targets the last — the layout of ``dataset=tokens``;
* ``task=classification`` / ``regression``: one sample per row, ``x`` a text column (tokenized, cut or
  padded to ``block_size``) or a numeric/list column, ``y`` the label or value column.

The rows become tensors once, at start-up, so ddplab's own sampler does the rest: exact sharding across ranks,
the same global batches at any world size, bitwise mid-epoch resume. A corpus bigger than memory is a job for
``scripts/make_tokens.py`` and ``dataset=tokens`` (or a stream): this source holds its tensors in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddplab.data import hf_stream
from ddplab.data.datasets import Splits, TensorData
from ddplab.data.hf_stream import HFStream, open_datasets, tokenizer_for
from ddplab.errors import InputError

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


def _files(path: str, key: str) -> list[str]:
    p = Path(path).expanduser()
    files = (
        sorted(str(f) for f in p.iterdir() if f.suffix in FORMATS)
        if p.is_dir()
        else [str(p)]
        if p.is_file()
        else []
    )
    if not files:
        raise InputError(
            f"dataset.{key}={path}: no {'/'.join(sorted(FORMATS))} file there. Fix: a local data "
            "file, or a folder of them (nothing is downloaded)"
        )
    kinds = {FORMATS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        raise InputError(
            f"dataset.{key}={path}: {sorted(Path(f).suffix for f in files)}: one format per split, "
            f"one of {', '.join(sorted(FORMATS))}. Fix: point it at files of one format"
        )
    return files


def load_rows(path: str, key: str, cache_dir: str | None = None) -> Any:
    """The rows of ``path`` (a file or a folder of files) as a map-style ``datasets.Dataset``; its files are
    kept as ``rows.ddplab_files`` (a bad row is then named by its file)."""
    files = _files(path, key)
    fmt = FORMATS[Path(files[0]).suffix]
    try:
        rows = open_datasets().load_dataset(fmt, data_files=files, split="train", cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - datasets' own error names no file: find the one that differs
        odd = hf_stream.columns_apart(files, fmt)
        if odd is None:
            raise
        raise InputError(
            f"dataset.{key}={path}: {odd}. Fix: give every file of one split the same columns "
            f"({type(e).__name__} from datasets)"
        ) from None
    rows.ddplab_files = (fmt, files, key)
    return rows


def _column(rows: Any, name: str, key: str) -> Any:
    if name not in rows.column_names:
        raise InputError(
            f"dataset.{key}={name}: no such column; the data has {rows.column_names}. "
            f"Fix: dataset.{key}=<one of them>"
        )
    col = rows[name]
    empty = next((i for i, v in enumerate(col) if v is None), None)
    if empty is not None:  # tokenizers' TypeError would name no file, row or column
        fmt, files, split = getattr(rows, "ddplab_files", (None, [], "path"))
        file, row = hf_stream.row_in_files(files, fmt, empty) if files else ("the data", empty)
        raise InputError(hf_stream.null_said(name, key, split, file, row))
    return col


def _encode(texts: list[str], tokenizer: str | None, key: str) -> list[list[int]]:
    tok = tokenizer_for(tokenizer, key)
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def _ids(rows: Any, x: str, tokenizer: str | None) -> list[list[int]]:
    """Each row's token ids: the column tokenized if it holds text, as it is if it holds ids."""
    col = _column(rows, x, "x")
    if len(col) and isinstance(col[0], str):
        return _encode(list(col), tokenizer, "x")
    return [list(map(int, r)) for r in col]


def lm_windows(
    rows: Any, x: str, tokenizer: str | None, block_size: int, vocab_size: int, key: str
) -> TensorData:
    """The rows' ids joined (in row order) and cut into windows of block_size + 1 tokens, non-overlapping."""
    ids = np.fromiter((t for r in _ids(rows, x, tokenizer) for t in r), dtype=np.int64)
    if ids.size and ids.max() >= vocab_size:
        raise InputError(
            f"dataset.{key}: token id {int(ids.max())} >= dataset.vocab_size={vocab_size}. "
            f"Fix: dataset.vocab_size={int(ids.max()) + 1} (the tokenizer's vocabulary)"
        )
    n = (ids.size - 1) // block_size
    if n < 1:
        raise InputError(
            f"dataset.{key}: {ids.size} tokens, fewer than one window of dataset.block_size="
            f"{block_size} + 1. Fix: more text, or a smaller dataset.block_size"
        )
    w = torch.from_numpy(ids[: n * block_size + 1])
    starts = torch.arange(n) * block_size
    idx = starts[:, None] + torch.arange(block_size + 1)
    win = w[idx]
    return TensorData(win[:, :-1].contiguous(), win[:, 1:].contiguous())


def labelled(rows: Any, x: str, y: str, tokenizer: str | None, block_size: int, pad_id: int) -> TensorData:
    """One sample per row: x (text tokenized, cut or padded to block_size with pad_id; or numbers), y."""
    col = _column(rows, x, "x")
    if len(col) and isinstance(col[0], str):
        seqs = [
            s[:block_size] + [pad_id] * (block_size - len(s[:block_size]))
            for s in _encode(list(col), tokenizer, "x")
        ]
        xs = torch.tensor(seqs, dtype=torch.int64)
    else:
        xs = torch.as_tensor(np.asarray(col), dtype=torch.float32)
    ys = torch.as_tensor(np.asarray(_column(rows, y, "y")))
    return TensorData(xs, ys.long() if not ys.is_floating_point() else ys.float())


def hf(
    path: str | None = None,
    val_path: str | None = None,
    x: str = "text",
    y: str | None = None,
    tokenizer: str | None = None,
    block_size: int = 64,
    vocab_size: int = 256,
    num_classes: int | None = None,
    pad_id: int = 0,
    val_fraction: float = 0.1,
    cache_dir: str | None = None,
    streaming: bool = False,
    num_samples: int | None = None,
) -> Splits:
    """``dataset=hf``: local files through ``datasets``; ``y`` None: language-model windows, else labelled
    rows. ``streaming``: read row by row in constant memory, as one stream (ddplab.data.hf_stream)."""
    if path is None:
        raise InputError(
            "dataset.path=None: dataset=hf reads local files. Fix: dataset.path=<a Parquet/JSONL/CSV/"
            "Arrow file or a folder of them>"
        )
    if streaming:
        return _streams(
            path, val_path, x, y, tokenizer, block_size, vocab_size, num_classes, pad_id, num_samples
        )
    rows = load_rows(path, "path", cache_dir)
    val_rows = load_rows(val_path, "val_path", cache_dir) if val_path else None

    def make(r: Any, key: str) -> TensorData:
        if y is None:
            return lm_windows(r, x, tokenizer, block_size, vocab_size, key)
        return labelled(r, x, y, tokenizer, block_size, pad_id)

    train = make(rows, "path")
    if val_rows is not None:
        val = make(val_rows, "val_path")
    else:  # the last val_fraction of the samples, never trained on
        k = max(1, int(len(train) * val_fraction))
        train, val = TensorData(train.x[:-k], train.y[:-k]), TensorData(train.x[-k:], train.y[-k:])
    classes = vocab_size if y is None else num_classes
    return Splits(train, val, classes)


def _streams(
    path: str,
    val_path: str | None,
    x: str,
    y: str | None,
    tokenizer: str | None,
    block_size: int,
    vocab_size: int,
    num_classes: int | None,
    pad_id: int,
    num_samples: int | None,
) -> Splits:
    if not val_path:
        raise InputError(
            "dataset.streaming=true needs dataset.val_path: a stream has no last fraction to hold out. "
            "Fix: dataset.val_path=<validation files>"
        )

    def stream(p: str, key: str, n: int | None) -> HFStream:
        files = _files(p, key)
        return HFStream(
            files, FORMATS[Path(files[0]).suffix], x, y, tokenizer, block_size, vocab_size, pad_id, n, key
        )

    open_datasets()  # the extra's one-line error before anything else
    return Splits(
        stream(path, "path", num_samples),
        stream(val_path, "val_path", None),
        vocab_size if y is None else num_classes,
    )
