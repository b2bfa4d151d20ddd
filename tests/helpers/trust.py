"""Shared by tests/unit/test_trust.py and tests/integration/test_trust.py."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import ddplab
from helpers.jobs import compose_cfg

TINY = ["model=mlp", "num_epochs=1", "limit_train_steps=2", "progress=none"]


class _Touch:
    """Unpickled, it runs ``touch <path>``: what a crafted pickle shipped in a run dir does."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sent") / "run"
    ddplab.run(compose_cfg(TINY, run))
    return run / "checkpoints" / "last.pt"


def payloads(tmp: Path) -> dict[str, tuple[dict, Path, str]]:
    """name -> (the model node a sender writes into the checkpoint, the file whose state shows it ran,
    how)."""
    shipped = tmp / "sent.pkl"
    shipped.write_bytes(pickle.dumps(_Touch(tmp / "pickle-ran")))
    victim = tmp / "victim.txt"
    victim.write_text("precious\n")
    return {
        "savetxt": (
            {"_target_": "numpy.savetxt", "fname": str(tmp / "written.txt"), "X": [[1.0]]},
            tmp / "written.txt",
            "exists",
        ),
        "pickle": (
            {"_target_": "numpy.load", "file": str(shipped), "allow_pickle": True},
            tmp / "pickle-ran",
            "exists",
        ),
        "open": ({"_target_": "builtins.open", "file": str(victim), "mode": "w"}, victim, "truncated"),
        # ddplab's own function that writes a file, nested inside a shipped model's arguments
        "nested": (
            {
                "_target_": "ddplab.models.MLP",
                "num_classes": 10,
                "act": {
                    "_target_": "ddplab.data.write_tokens",
                    "tokens": [1],
                    "path": str(tmp / "tokens.bin"),
                    "dtype": "uint16",
                    "vocab_size": 2,
                },
            },
            tmp / "tokens.bin",
            "exists",
        ),
        # another spelling of torch.load, through a shipped module's own imports
        "alias": (
            {"_target_": "ddplab.models.torch.load", "f": str(shipped), "weights_only": False},
            tmp / "pickle-ran",
            "exists",
        ),
    }


def ran(marker: Path, how: str) -> bool:
    return marker.exists() if how == "exists" else marker.read_text() != "precious\n"


def crafted(trained: Path, tmp: Path, model: dict) -> Path:
    ck = torch.load(trained, map_location="cpu", weights_only=True)
    cfg = OmegaConf.create(ck["meta"]["config"])
    cfg.model = model
    ck["meta"]["config"] = OmegaConf.to_yaml(cfg)  # as ddplab stores it
    path = tmp / "sent" / "checkpoints" / "last.pt"
    path.parent.mkdir(parents=True)
    torch.save(ck, path)
    return path
