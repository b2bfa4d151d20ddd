"""Shared by tests/unit/test_hf_stream.py and tests/integration/test_hf_stream.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddplab.data import tokenizer as tz
from ddplab.data.tabular import generated_corpus
from helpers.extras import lazy
from helpers.hf_data import GPT, text_lm

datasets = lazy("datasets", "hf")


def texts(rows: int) -> list[str]:
    sentences = generated_corpus(sentences=3 * rows, seed=5).strip().split(". ")
    return [". ".join(sentences[i : i + 3]) + "." for i in range(0, len(sentences), 3)][:rows]


def files(tmp_path: Path, n: int = 3, rows: int = 60) -> tuple[Path, Path, list[list[str]]]:
    """``n`` Parquet files of ``rows`` text rows each (row groups of 8), a JSONL validation file, a BPE on
    them."""
    parts = [texts(n * rows + 20)[i * rows : (i + 1) * rows] for i in range(n)]
    (tmp_path / "train").mkdir()
    for i, part in enumerate(parts):
        datasets.Dataset.from_dict({"text": part, "label": [int("dog" in t) for t in part]}).to_parquet(
            tmp_path / "train" / f"part-{i}.parquet", batch_size=8
        )
    (tmp_path / "val.jsonl").write_text(
        "".join(json.dumps({"text": t, "label": int("dog" in t)}) + "\n" for t in texts(n * rows + 20)[-20:])
    )
    tz.train_bpe([t for p in parts for t in p], 320).save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "train", tmp_path / "val.jsonl", parts


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def lm_args(tmp_path: Path) -> list[str]:
    train, val, _ = files(tmp_path)
    return text_lm(tmp_path, train, val) + ["dataset.streaming=true", "model.dropout=0"] + GPT
