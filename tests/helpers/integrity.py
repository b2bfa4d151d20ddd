"""Shared by tests/unit/test_integrity.py and tests/integration/test_integrity.py."""

from __future__ import annotations

BASE = ["model=mlp", "num_epochs=2", "progress=none"]  # digits: 22 steps per epoch
