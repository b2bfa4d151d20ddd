"""Bring your own task: the shipped examples (vae, regression, lm) and a user's own task, dataset
and collate function from a package outside the repo, with everything classification has —
exact metrics over world sizes, bitwise resume, sweeps, clear errors for bad task output."""

from __future__ import annotations

import pytest
from helpers.jobs import compose_cfg

import ddplab
from ddplab.task import TaskError


# --------------------------------------------------------------------------- bad task output
@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            ["task._target_=toy.BadTask", "+task.fault=vector_loss"],
            r"BadTask returned a loss of shape \(3,\); it must be a scalar tensor .* Fix: return "
            r"loss.mean\(\)",
        ),
        (
            ["task._target_=toy.BadTask", "+task.fault=zero_count"],
            r"metric 'acc' has count 0 over \d+ samples \(training, .*task BadTask\)",
        ),
        (
            ["dataset._target_=toy.ragged_digits"],
            r"ClassificationTask was given a batch whose tensors disagree on the batch size .*batch\[0\] "
            r"\(64, 1, 8, 8\), "
            r"batch\[1\] \(63,\)",
        ),
    ],
)
def test_bad_task_output_or_batch_is_a_clear_error_naming_the_task(tmp_path, overrides, match):
    with pytest.raises(TaskError, match=match):
        ddplab.run(
            compose_cfg(
                ["model=mlp", "num_epochs=1", "progress=none", "perf.data_on_device=false", *overrides],
                tmp_path / "r",
            )
        )
