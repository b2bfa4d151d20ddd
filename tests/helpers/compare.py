"""One bitwise comparison, for checkpoints and anything nested in them (the tests' and the soak's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def same(a: Any, b: Any, where: str = "") -> str | None:
    """Where two values differ (tensors: dtype and every bit), or None. Dicts, lists and tuples are walked."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return None if ok else where
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where} keys {sorted(map(str, a.keys() ^ b.keys()))}"
        return next((d for k in a if (d := same(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where} length {len(a)} vs {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := same(x, y, f"{where}[{i}]"))), None)
    return None if a == b or (a != a and b != b) else f"{where}: {a!r} vs {b!r}"  # NaN == NaN here


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_checkpoint(a: dict[str, Any] | Path, b: dict[str, Any] | Path,
                           entries: tuple[str, ...] = ("model", "optimizer", "scheduler", "loop")) -> None:
    """Checkpoints ``a`` and ``b`` (dicts or paths) hold bit-identical ``entries``."""
    a, b = (load(x) if isinstance(x, Path) else x for x in (a, b))
    for key in entries:
        diff = same(a[key], b[key], key)
        assert diff is None, f"checkpoints differ at {diff}"
