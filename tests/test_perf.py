"""Performance guarantees that can be checked on CPU: what runs per step, and the fast paths."""

from __future__ import annotations

import pytest

from conftest import count_steps

pytestmark = pytest.mark.dist


def test_no_collectives_or_syncs_on_non_log_steps(tmp_path):
    """Between two optimizer steps that are not log steps: zero collectives, zero host reads.

    Clipping and bf16 autocast are on (both could sneak in a sync), 2 epochs of
    digits on 2 ranks, a log every 5 steps.
    """
    log_every, spe = 5, 22  # 1,437 train digits // global batch 64
    args = ["model=mlp", "num_epochs=2", f"log_every_n_steps={log_every}", "grad_clip=1.0", "amp=true",
            "progress=log", "run_dir=run"]
    for rank, steps in enumerate(count_steps(tmp_path, 2, args)):
        assert len(steps) == 2 * spe
        # steps[k] covers what ran after optimizer step k (1-based) and up to step k+1.
        for k in range(1, len(steps)):
            done = k  # optimizer steps completed before this interval began
            where = f"rank {rank}, between steps {done} and {done + 1}"
            if done % spe == 0:
                continue  # epoch end: evaluation and checkpoint (collectives by design)
            if done % log_every == 0:
                # The log step: exactly one collective (the packed metrics), and host reads.
                assert steps[k]["collectives"] == 1, (where, steps[k])
                assert steps[k]["syncs"] > 0, (where, steps[k])  # the counter works
            else:
                assert steps[k] == {"collectives": 0, "syncs": 0, "cuda_syncs": 0}, (where, steps[k])
