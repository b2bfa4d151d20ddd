"""One bitwise comparison, for checkpoints and anything nested in them (the tests' and the soak's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ddplab.checkpoint.compare import first_difference


def same(a: Any, b: Any, where: str = "") -> str | None:
    """Where two values differ (tensors: dtype and every bit), or None: ddplab's own comparison."""
    return first_difference(a, b, where)


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_checkpoint(a: dict[str, Any] | Path, b: dict[str, Any] | Path,
                           entries: tuple[str, ...] = ("model", "optimizer", "scheduler", "loop")) -> None:
    """Checkpoints ``a`` and ``b`` (dicts or paths) hold bit-identical ``entries``."""
    a, b = (load(x) if isinstance(x, Path) else x for x in (a, b))
    for key in entries:
        diff = same(a[key], b[key], key)
        assert diff is None, f"checkpoints differ at {diff}"
