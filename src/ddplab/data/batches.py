"""Batches of any nested structure: tensors in tuples, lists, dicts (and namedtuples).

The trainer moves whatever a dataset (or a user's collate function) yields to the
device without knowing its shape; a task unpacks it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor


def map_tensors(batch: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it; other leaves unchanged."""
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return (
            type(batch)({k: map_tensors(v, fn) for k, v in batch.items()})
            if type(batch) is not dict
            else {k: map_tensors(v, fn) for k, v in batch.items()}
        )
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def move(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor of ``batch`` on ``device`` (a no-op for tensors already there)."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def tensors(batch: Any, path: str = "batch") -> list[tuple[str, Tensor]]:
    """(where, tensor) for every tensor in ``batch``: ``batch[0]``, ``batch['x']``, ..."""
    if isinstance(batch, Tensor):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        return [t for k, v in batch.items() for t in tensors(v, f"{path}[{k!r}]")]
    if isinstance(batch, (list, tuple)):
        return [t for i, v in enumerate(batch) for t in tensors(v, f"{path}[{i}]")]
    return []


def first_tensor(batch: Any) -> Tensor | None:
    found = tensors(batch)
    return found[0][1] if found else None


def in_memory_format(batch: Any, fmt: torch.memory_format | None) -> Any:
    """Image batches (4-D float tensors) in the model's memory format (NHWC with perf.channels_last); None:
    the batch as it is."""
    if fmt is None:
        return batch
    return map_tensors(
        batch, lambda t: t.contiguous(memory_format=fmt) if t.dim() == 4 and t.is_floating_point() else t
    )
