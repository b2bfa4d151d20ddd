"""Shared by tests/unit/test_checkpoints.py and tests/integration/test_checkpoints.py."""

from __future__ import annotations

import pytest
import torch

from helpers.jobs import read_scalars


@pytest.fixture(autouse=True)
def fresh_faults():
    import toy

    toy._FAULTED.clear()  # in-process runs share toy's once-per-process fault memory


FAULTY = [
    "model=mlp",
    "model._target_=toy.FaultyMLP",
    "num_epochs=2",
    "checkpoint.every_n_steps=5",
    "log_every_n_steps=5",
    "progress=none",
]  # mlp has dropout: RNG state must be restored too


def final_state(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def steps_of(run_dir, tag="train/loss"):
    return [s for s, _ in read_scalars(run_dir / "tb")[tag]]
