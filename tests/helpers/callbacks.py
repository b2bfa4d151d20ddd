"""Shared by the callback tests (tests/integration/test_callbacks.py, test_eval_presets_provenance.py)."""

from __future__ import annotations

BASE = ["model=mlp", "progress=none"]  # digits: 22 steps per epoch
