"""Exact evaluation for any task: this rank's shard of the validation set through the task's
evaluation step, one collective for the sums, the task's derived scalars, and its
``visualize`` hook on the first batch."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from ddplab.data import Splits, eval_batches
from ddplab.data.sampling import eval_span
from ddplab.precision import Precision
from ddplab.runtime.group import Dist
from ddplab.task import check_batch, check_output, name_of
from ddplab.train.metrics import SumMeter


def derived(task: Any, values: dict[str, float], prefix: str) -> dict[str, float]:
    """The task's extra scalars from reduced means (``train/`` or ``val/`` ones), under the same prefix."""
    derive = getattr(task, "derive", None)
    if derive is None:
        return {}
    means = {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}
    return {f"{prefix}{k}": float(v) for k, v in derive(means).items()}


class Evaluator:
    def __init__(
        self,
        task: Any,
        module: nn.Module,
        data: Splits,
        dist: Dist,
        precision: Precision,
        strategy: Any,
        batch_size: int,
        to_memory_format: Callable[[Any], Any],
        max_batches: int | None = None,
    ):
        """``max_batches``: evaluate at most this many batches per rank (limit_val_batches; debugging)."""
        self.task, self.module, self.data, self.dist = task, module, data, dist
        self.precision, self.strategy, self.batch_size, self.to_memory_format = (
            precision,
            strategy,
            batch_size,
            to_memory_format,
        )
        self.max_batches = max_batches
        self.step = getattr(task, "evaluate", task)
        # this rank's first validation batch (for visualize and FSDP's extra forwards)
        self.sample: Any = None
        self._checked = False

    def _batches(self, world_size: int, rank: int, batch_size: int) -> Any:
        return eval_batches(
            self.data.val, world_size, rank, batch_size, self.dist.device, self.data.collate_fn
        )

    def _common_batches(self) -> int:
        """The fewest batches any rank evaluates: only those may hold a collective every rank reaches."""
        n, ws = len(self.data.val), self.dist.world_size
        common = min(math.ceil(len(eval_span(n, ws, r)) / self.batch_size) for r in range(ws))
        return min(common, self.max_batches) if self.max_batches is not None else common

    @torch.no_grad()
    def evaluate(self, stopper: Any = None) -> dict[str, float] | None:
        """``stopper`` (a runtime.stopping.StopAgreement): None is returned on every rank when all
        agreed to stop part-way (a preemption signal during a long evaluation)."""
        dist, task = self.dist, self.task
        self.strategy.before_eval(self.module)
        self.module.eval()
        meter = SumMeter(dist.device, getattr(task, "metric_names", ()))
        done, first = 0, None
        common = 0
        if stopper is not None:
            stopper.start_eval()
            common = self._common_batches()
        for batch in self._batches(dist.world_size, dist.rank, self.batch_size):
            if self.max_batches is not None and done >= self.max_batches:
                break
            batch = self.to_memory_format(batch)
            if not self._checked:
                check_batch(task, batch)
            with self.precision.autocast():
                out = self.step(self.module, batch)  # unwrapped: no DDP collectives on uneven shards
            if not self._checked:
                out, self._checked = check_output(task, out), True
            meter.update(out)
            first = batch if first is None else first
            done += 1
            if stopper is not None and stopper.after_eval_batch(done - 1, common):
                return None  # every rank stops at this same batch: no further collective here
        # A rank with an empty shard borrows one sample: FSDP needs the same number of forwards everywhere.
        self.sample = (
            first if first is not None else self.to_memory_format(next(iter(self._batches(1, 0, 1))))
        )

        def forward() -> None:
            with self.precision.autocast():
                self.step(self.module, self.sample)

        # rank 0's
        needed = math.ceil(len(eval_span(len(self.data.val), dist.world_size, 0)) / self.batch_size)
        needed = min(needed, self.max_batches) if self.max_batches is not None else needed
        self.strategy.finish_eval(self.module, done, needed, forward)
        values = meter.reduce(dist, f"evaluation; task {name_of(task)}")
        values.update(derived(task, values, "val/"))
        return values

    @torch.no_grad()
    def visualize(self, writer: Any, step: int) -> None:
        """The task's drawing of this evaluation (every rank runs it; the writer draws on rank 0 only)."""
        draw = getattr(self.task, "visualize", None)
        if draw is None or self.sample is None:
            return
        self.module.eval()
        with self.precision.autocast():
            draw(self.module, self.sample, writer, step)
