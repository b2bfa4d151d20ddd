"""Shared by the token-file tests (tests/integration/test_tokens.py, test_tokenizer.py, test_steps.py): the
tiny language model they train on a token file, its overrides, and token shards written to train on."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers.jobs import REPO, assert_ok, run_cmd

# A 1-layer GPT of width 32 on a token file, windows of 16 tokens; each test module picks its batch and
# console (test_steps': batch 48 to have 245 steps an epoch, and the step lines it reads).
TINY_LM = [
    "task=lm",
    "dataset=tokens",
    "dataset.block_size=16",
    "model.n_embd=32",
    "model.n_layer=1",
    "model.n_head=2",
]
LM = TINY_LM + ["batch_size=12", "progress=none"]


def files(train: Path, val: Path) -> list[str]:
    return [f"dataset.path={train}", f"dataset.val_path={val}"]


def generated(out: Path, mb: float, *more: str) -> Path:
    """A generated corpus of ``mb`` MB made into token files in ``out`` by the shipped script
    (scripts/make_tokens.py, forked from the job server), with its further arguments ``more``."""
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "make_tokens.py"),
        "--generated-mb",
        str(mb),
        "--out",
        str(out),
    ]
    assert_ok(run_cmd([*cmd, *more], out.parent))
    return out


def corpus(out: Path, mb: float) -> list[str]:
    """The overrides that train on a generated corpus of ``mb`` MB, written to ``out``."""
    generated(out, mb)
    return files(out / "train.bin", out / "val.bin")


# --------------------------------------------------------------------------- a folder of shards, streamed
def shards(tmp_path: Path, n: int = 4) -> tuple[Path, Path]:
    out = generated(tmp_path / "data", 0.02, "--shards", str(n))
    return out / "train", out / "val.bin"
