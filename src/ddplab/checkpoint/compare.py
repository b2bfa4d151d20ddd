"""Where two checkpoints (or anything nested in them) first differ: the one comparison that
``mode=verify_resume``, the tests and the soak use."""

from __future__ import annotations

from typing import Any

import torch


def first_difference(a: Any, b: Any, where: str = "", rtol: float = 0.0) -> str | None:
    """The dotted path of the first difference, or None. Tensors: dtype and every bit (``rtol`` > 0:
    floating tensors to that relative tolerance). Dicts, lists and tuples are walked in order."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
            return where
        if a.shape != b.shape:
            return f"{where} shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if rtol and a.is_floating_point():  # near-zero entries: absolute to the tensor's own scale
            atol = rtol * float(a.abs().max()) if a.numel() else 0.0
            return None if torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True) else where
        return None if torch.equal(a, b) else where
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where} keys {sorted(map(str, a.keys() ^ b.keys()))}"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{where}.{k}", rtol))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where} length {len(a)} vs {len(b)}"
        return next(
            (d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{where}[{i}]", rtol))),
            None,
        )
    if isinstance(a, float) and isinstance(b, float) and rtol:
        return None if abs(a - b) <= rtol * max(abs(a), abs(b)) else f"{where}: {a!r} vs {b!r}"
    return None if a == b or (a != a and b != b) else f"{where}: {a!r} vs {b!r}"  # NaN == NaN here
