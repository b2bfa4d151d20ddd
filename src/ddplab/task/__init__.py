"""The task seam: what one batch means — ``batch → loss + named (sum, count) metrics``.

The trainer owns the loop (autocast, backward, no-sync, steps); a task owns
only the model call, the loss and the per-batch metric sums. The metric
names are declared up front (:attr:`Task.metric_names`), so every rank packs
the same row even when its shard is empty, and the one-collective reduction
carries them without knowing them in advance: a metric ``m`` is logged as
``train/m`` and ``val/m`` = (sum over batches and ranks) / (count over them).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Union

import torch.nn.functional as F
from torch import Tensor, nn

Number = Union[int, float]


class TaskOutput(NamedTuple):
    loss: Tensor  # scalar, the batch mean that is backpropagated
    size: int  # samples in the batch (shape metadata: no sync): weights `loss` in train/loss, val/loss
    # name -> (sum, count) over the batch; a device tensor or a number each (numbers cost no kernel).
    metrics: dict[str, tuple[Union[Tensor, Number], Union[Tensor, Number]]]


class Task(Protocol):
    metric_names: tuple[str, ...]

    def __call__(self, model: nn.Module, batch: Any) -> TaskOutput:
        """Forward ``batch`` through ``model`` (called under autocast); never reads values on the host."""


class ClassificationTask:
    """(images, labels) → cross-entropy, and accuracy as (correct, samples)."""

    metric_names = ("acc",)

    def __call__(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> TaskOutput:
        x, y = batch
        logits = model(x)
        # float32 logits for the loss either way: autocast runs cross_entropy in float32 too.
        loss = F.cross_entropy(logits.float(), y)
        n = y.numel()
        return TaskOutput(loss, n, {"acc": ((logits.argmax(-1) == y).sum(), n)})
