"""Shared by tests/unit/test_strategies.py and tests/integration/test_strategies.py."""

from __future__ import annotations

ARGS = ["model=mlp", "num_epochs=2", "log_every_n_steps=5", "progress=none"]
