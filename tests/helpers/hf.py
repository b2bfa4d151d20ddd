"""Shared by tests/unit/test_hf.py and tests/integration/test_hf.py."""

from __future__ import annotations

from pathlib import Path

from ddplab.data import write_tokens
from ddplab.data.tabular import generated_corpus

# A 2-layer GPT-2 of width 32, no dropout (dropout draws per rank: world sizes would differ by it alone).
HF = [
    "model=hf",
    "model.config.n_embd=32",
    "model.config.n_layer=2",
    "model.config.n_head=2",
    "+model.config.resid_pdrop=0.0",
    "+model.config.embd_pdrop=0.0",
    "+model.config.attn_pdrop=0.0",
]


LM = ["task=lm", "dataset=tokens", "dataset.block_size=16", "batch_size=12", "progress=none"] + HF


def token_file(tmp_path: Path) -> list[str]:
    text = list(generated_corpus(sentences=700, seed=1).encode())
    write_tokens(text, tmp_path / "t.bin", "uint16", 256)
    return [f"dataset.path={tmp_path / 't.bin'}"]
