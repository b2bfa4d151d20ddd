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


# --------------------------------------------------------------------------- a folder of shards, streamed
def shards(tmp_path: Path, n: int = 4) -> tuple[Path, Path]:
    out = tmp_path / "data"
    assert_ok(
        run_cmd(
            [
                sys.executable,
                str(REPO / "scripts" / "make_tokens.py"),
                "--generated-mb",
                "0.02",
                "--out",
                str(out),
                "--shards",
                str(n),
            ],
            tmp_path,
        )
    )
    return out / "train", out / "val.bin"
