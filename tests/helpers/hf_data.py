"""dataset=hf on text files with a BPE learnt on them (tests/integration/test_hf_data.py), and what the
streaming tests' files (helpers/hf_stream.py) share with them: the tokenizer beside the files and its 320
ids, ddplab's source opened on them, the overrides of a small GPT trained on them."""

from __future__ import annotations

import json
from pathlib import Path

from ddplab.data import tokenizer as tz
from ddplab.data.hf import hf
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


def source(tmp_path: Path, train: Path, val: Path, **kw: object):
    """ddplab's dataset=hf on ``train`` and ``val`` (``corpus``'s or ``helpers.hf_stream.files``'), read with
    the BPE they wrote to ``tmp_path/tokenizer.json`` (320 ids), in windows of 16 tokens; ``kw``: hf's
    other arguments."""
    return hf(
        str(train), str(val), tokenizer=str(tmp_path / "tokenizer.json"), block_size=16, vocab_size=320, **kw
    )


def text_lm(tmp_path: Path, train: Path, val: Path) -> list[str]:
    """The overrides that train a language model on ``source``'s files, as it reads them (batch 12)."""
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
    ]


def lm_args(tmp_path: Path) -> list[str]:
    train, val, _ = corpus(tmp_path)
    return text_lm(tmp_path, train, val) + [f"dataset.cache_dir={tmp_path / 'cache'}"] + GPT
