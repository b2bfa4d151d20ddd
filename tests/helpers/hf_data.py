"""Shared by tests/unit/test_hf_data.py and tests/integration/test_hf_data.py."""

from __future__ import annotations

import json
from pathlib import Path

from ddplab.data import tokenizer as tz
from ddplab.data.tabular import generated_corpus
from helpers.extras import lazy

datasets = lazy("datasets", "hf")


GPT = ["model=gpt", "model.n_embd=32", "model.n_layer=1", "model.n_head=2"]


def corpus(tmp_path: Path, rows: int = 240) -> tuple[Path, Path, list[str]]:
    """A Parquet file of text rows (and a JSONL validation file), and the BPE tokenizer learnt on them."""
    sentences = generated_corpus(sentences=4 * rows, seed=2).strip().split(". ")
    texts = [". ".join(sentences[i : i + 4]) + "." for i in range(0, len(sentences), 4)]
    train, val = texts[: rows * 9 // 10], texts[rows * 9 // 10 :]
    datasets.Dataset.from_dict({"text": train, "id": list(range(len(train)))}).to_parquet(
        tmp_path / "train.parquet"
    )
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in val))
    tz.train_bpe(train, 320).save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "train.parquet", tmp_path / "val.jsonl", train


def lm_args(tmp_path: Path) -> list[str]:
    train, val, _ = corpus(tmp_path)
    return [
        "task=lm",
        "dataset=hf",
        f"dataset.path={train}",
        f"dataset.val_path={val}",
        f"dataset.tokenizer={tmp_path / 'tokenizer.json'}",
        "dataset.vocab_size=320",
        "dataset.block_size=16",
        "batch_size=12",
        "progress=none",
        f"dataset.cache_dir={tmp_path / 'cache'}",
    ] + GPT
