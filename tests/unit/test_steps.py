"""A run's length by steps (issue 33), in-process: RunLength's total steps from ``num_epochs`` and
``max_steps``, a cosine schedule over the run's steps whose warmup fraction is the same steps at any world
size, and the console's ETA at the slowest rank's pace."""

from __future__ import annotations

import pytest
import torch
from helpers.jobs import compose_cfg

from ddplab.optim import cosine
from ddplab.train.length import RunLength

# A SIGTERM inside a step evaluation, mid-epoch, resumed bitwise with each evaluation logged once: at 3 ranks
# in tests/integration/test_resume_world_sizes.py (this test's 2-rank stop checked nothing that one does not).


def test_the_eta_is_the_training_left_at_the_slowest_ranks_pace():
    """The step time is measured, so a test cannot know which of the three forms a real run prints (a loaded
    CI machine made 12 s into 1m24s): each form, from a given pace."""
    from ddplab.train.reporting import Progress

    p = Progress("none", length=RunLength(1, None, 250))
    assert [
        p._eta(step, {"vitals/step_time_ms_max": ms})
        for step, ms in ((50, 60.0), (50, 925.0), (10, 15525.0), (250, 60.0))
    ] == ["  ETA 12s", "  ETA 3m05s", "  ETA 1h02m", ""]


def test_a_schedule_spans_the_runs_steps_and_a_warmup_fraction_is_the_same_steps_at_any_world_size():
    assert RunLength(100, 20, None).total_steps == 2000 and RunLength(100, None, 350).total_steps == 350
    assert RunLength(100, 2, 350).total_steps == 200 and RunLength(100, 5, 350).epochs == 4
    p = torch.nn.Parameter(torch.zeros(1))
    lrs = []
    sched = cosine(torch.optim.SGD([p], lr=1.0), total_steps=600, steps_per_epoch=234, warmup_fraction=0.05)
    for _ in range(600):
        lrs.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    assert lrs[29] == 1.0 and lrs[28] < 1.0 and lrs[0] == pytest.approx(1 / 30)  # 30 warmup steps = 5% of 600
    assert lrs[-1] == pytest.approx(0.0, abs=1e-4)  # the decay ends at the run's last step, not an epoch's
    # The steps a schedule sees do not depend on the world size: the composed config alone fixes them.
    cfg = compose_cfg(["max_steps=600", "num_epochs=null", "scheduler.warmup_fraction=0.05"])
    assert cfg.scheduler.warmup_fraction == 0.05
