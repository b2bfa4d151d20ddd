"""Shared by tests/unit/test_tokenizer.py and tests/integration/test_tokenizer.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from ddplab.data.tabular import generated_corpus
from helpers.jobs import REPO


def make_tokens() -> object:
    spec = importlib.util.spec_from_file_location("make_tokens", REPO / "scripts" / "make_tokens.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def text_file(tmp_path: Path, sentences: int = 3000) -> Path:
    """A book of lines of 1-6 sentences, some lines indented or blank (cuts only between non-space bytes)."""
    said = generated_corpus(sentences=sentences, seed=3).strip().split(". ")
    lines, i = [], 0
    while i < len(said):
        n = 1 + i % 6
        lines.append(
            ("  " if i % 7 == 0 else "") + ". ".join(said[i : i + n]) + ("." if i + n < len(said) else "")
        )
        lines += [""] if i % 11 == 0 else []
        i += n
    path = tmp_path / "book.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ids(path: Path) -> np.ndarray:
    meta = json.loads(Path(f"{path}.json").read_text())
    return np.fromfile(path, dtype=meta["dtype"]).astype(np.int64)
