"""Two ranks under torchrun whose every step is equally slow (6 s): StallWatch says nothing, as no rank waits
for another."""

from __future__ import annotations

import pytest
from helpers.jobs import assert_ok, torchrun


@pytest.mark.dist
def test_two_ranks_equally_slow_say_nothing(tmp_path):
    """Every step takes 6 s on both ranks (a big model, emulated bf16): no rank waits for another, so no rank
    says it does — the old watch blamed a peer at step 1 ("has run 5s ... waiting for another rank")."""
    proc = torchrun(
        2,
        [
            "model=mlp",
            "model._target_=toy.SlowMLP",
            "+model.delay_s=6",
            "num_epochs=1",
            "limit_train_steps=3",
            "progress=log",
        ],
        tmp_path,
        timeout=180,
    )
    assert_ok(proc)
    assert "has run" not in proc.stdout + proc.stderr
