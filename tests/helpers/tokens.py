"""Shared by tests/unit/test_tokens.py and tests/integration/test_tokens.py."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers.jobs import REPO, assert_ok, run_cmd

LM = [
    "task=lm",
    "dataset=tokens",
    "dataset.block_size=16",
    "model.n_embd=32",
    "model.n_layer=1",
    "model.n_head=2",
    "batch_size=12",
    "progress=none",
]


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
