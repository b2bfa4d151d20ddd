"""The task seam: what one batch means — ``batch → loss + named (sum, count) metrics``.

The trainer owns the loop (device placement, autocast, backward, accumulation,
clipping, no-sync, steps, exact reduction); a task owns the model call, the loss
and the per-batch metric sums. Subclass :class:`Task` (or write any class with
the same attributes) and name it from a yaml: ``task: {_target_: mypkg.MyTask}``.

* ``metric_names``: declared up front, so every rank packs the same row even when
  its shard is empty; metric ``m`` is logged as ``train/m`` and ``val/m`` =
  (sum over batches and ranks) / (count over them) — exact for any world size.
* ``__call__(model, batch)``: the training step's forward (under autocast); a
  batch is whatever the dataset (or its collate function) yields, already on
  the device: a tensor pair, a tuple, a dict of tensors. Never read values on
  the host here (``.item()``): that would sync every step.
* ``evaluate(model, batch)`` (optional): the evaluation forward; default ``__call__``.
* ``derive(means)`` (optional): extra scalars computed from the reduced means
  (``{"loss": .., "m": ..}``) after each log step and evaluation, e.g. perplexity.
* ``visualize(model, batch, writer, step)`` (optional): after each evaluation, on
  every rank (the model may be sharded), with this rank's first validation batch;
  the writer draws only on rank 0 (``writer.image``, ``writer.scalars``, ``writer.text``).
* ``maximize``: metric names where higher is better (``objective`` and the best
  checkpoint follow it); every other metric, and the loss, is minimised.
* ``counts_tokens``: samples are sequences (the first tensor of a batch is (B, T)):
  ``vitals/tokens_per_s`` and the progress line count tokens, T per sample.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

import torch.nn.functional as F
from torch import Tensor, nn

from ddplab.data.batches import tensors

Number = Union[int, float]


class TaskOutput(NamedTuple):
    loss: Tensor  # scalar, the batch mean that is backpropagated
    size: int  # samples in the batch (shape metadata: no sync): weights `loss` in train/loss, val/loss
    # name -> (sum, count) over the batch; a device tensor or a number each (numbers cost no kernel).
    metrics: dict[str, tuple[Union[Tensor, Number], Union[Tensor, Number]]]


class TaskError(ValueError):
    """A task returned something the trainer cannot use; the message names the task, the value and the fix."""


class Task:
    """Base class with the optional parts' defaults (subclassing is optional: duck typing works)."""

    metric_names: tuple[str, ...] = ()
    derived_names: tuple[str, ...] = ()  # what derive() returns
    maximize: tuple[str, ...] = ()
    counts_tokens: bool = False

    def __call__(self, model: nn.Module, batch: Any) -> TaskOutput:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, batch: Any) -> TaskOutput:
        return self(model, batch)

    def derive(self, means: dict[str, float]) -> dict[str, float]:
        return {}

    def visualize(self, model: nn.Module, batch: Any, writer: Any, step: int) -> None:
        pass


def name_of(task: Any) -> str:
    return type(task).__name__


def logged_names(task: Any) -> list[str]:
    """The names a task's metrics are logged under (without the train/ or val/ prefix)."""
    return ["loss", *getattr(task, "metric_names", ()), *getattr(task, "derived_names", ())]


def check_objective(objective: str, task: Any, callback_names: list[str]) -> bool:
    """The objective must be a metric the task (or a callback: val_ema/*) logs, else no best checkpoint is
    kept and sweepers and studies get None: a ConfigError listing the ones there are. Whether it is
    minimised."""
    names = [f"val/{m}" for m in logged_names(task)] + list(callback_names)
    if objective not in names:
        from ddplab.config.errors import ConfigError

        raise ConfigError(
            f"objective={objective!r}: {name_of(task)} logs no such metric. "
            f"Fix: objective= one of {', '.join(names)}"
        )
    return objective.split("/", 1)[-1] not in getattr(task, "maximize", ())


def check_batch(task: Any, batch: Any) -> None:
    """A batch's tensors must agree on their leading (sample) dim (checked on the first batches only)."""
    found = [(where, tuple(t.shape)) for where, t in tensors(batch) if t.dim() > 0]
    if len({shape[0] for _, shape in found}) > 1:
        listed = ", ".join(f"{w} {s}" for w, s in found)
        raise TaskError(
            f"{name_of(task)} was given a batch whose tensors disagree on the batch size (leading dim): "
            f"{listed}. Fix: make the dataset (or its collate function) return one row per sample in "
            "every tensor"
        )


def check_output(task: Any, out: Any) -> TaskOutput:
    """What a task returned, checked once (first training and evaluation batch): host metadata only."""
    name = name_of(task)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise TaskError(
            f"{name} returned {type(out).__name__}; it must return TaskOutput(loss, size, metrics). "
            "Fix: return ddplab.task.TaskOutput(loss, batch_size, {name: (sum, count)})"
        )
    out = TaskOutput(*out)
    if not isinstance(out.loss, Tensor) or out.loss.dim() != 0:
        shape = tuple(out.loss.shape) if isinstance(out.loss, Tensor) else type(out.loss).__name__
        raise TaskError(
            f"{name} returned a loss of shape {shape}; it must be a scalar tensor (the batch mean). "
            "Fix: return loss.mean()"
        )
    if not isinstance(out.size, int) or out.size <= 0:
        raise TaskError(
            f"{name} returned size={out.size!r}; it must be the number of samples in the batch (an int "
            "> 0). Fix: return len(batch[0]) or x.shape[0]"
        )
    declared = tuple(getattr(task, "metric_names", ()))
    if set(out.metrics) != set(declared):
        raise TaskError(
            f"{name} returned metrics {sorted(out.metrics)} but declares metric_names={declared}. "
            "Fix: return exactly the declared names"
        )
    for m, pair in out.metrics.items():
        if not (isinstance(pair, tuple) and len(pair) == 2) or any(
            isinstance(v, Tensor) and v.dim() != 0 for v in pair
        ):
            raise TaskError(
                f"{name}: metric {m!r} is {pair!r}; it must be a (sum, count) pair of numbers or scalar "
                "tensors. Fix: return (values.sum(), values.numel())"
            )
    return out


class ClassificationTask(Task):
    """(images, labels) → cross-entropy, and accuracy as (correct, samples)."""

    metric_names = ("acc",)
    maximize = ("acc",)

    def __call__(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> TaskOutput:
        x, y = batch
        logits = model(x)
        # float32 logits for the loss either way: autocast runs cross_entropy in float32 too.
        loss = F.cross_entropy(logits.float(), y)
        n = y.numel()
        return TaskOutput(loss, n, {"acc": ((logits.argmax(-1) == y).sum(), n)})
