"""task=regression: mean squared error as the loss, with MSE and MAE as exact metrics."""

from __future__ import annotations

from torch import Tensor, nn

from ddplab.task import Task, TaskOutput


class RegressionTask(Task):
    """(features, targets) → MSE; ``mse`` and ``mae`` as (sum of errors, samples)."""

    metric_names = ("mse", "mae")

    def __call__(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> TaskOutput:
        x, y = batch
        err = model(x).float().reshape(y.shape) - y.float()
        sq = err.pow(2)
        n = y.shape[0]
        return TaskOutput(sq.mean(), n, {"mse": (sq.sum(), n), "mae": (err.abs().sum(), n)})
