"""fp16's GradScaler skips the steps whose gradients overflow, most often the first ones (its first scale,
65536, is too big for most models). A skipped step must leave the weights and the optimizer's state as
they were, whichever optimizer and kernel (fused or not) take it: here one such step is made on purpose
(tests/toy_callbacks.InfGradAtStep) and the run must go on as if it had never been taken."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.jobs import compose_cfg, read_scalars

import ddplab

pytestmark = pytest.mark.slow

# mlp on digits, 22 steps: step 1's gradient made inf. On CPU, fp16 autocast is emulated (slow), but an MLP
# of 85k parameters still takes about a second.
BASE = [
    "model=mlp",
    "num_epochs=1",
    "amp=true",
    "amp_dtype=float16",
    "log_every_n_steps=1",
    "grad_clip=1.0",
    "progress=none",
    "+callbacks.inf._target_=toy.InfGradAtStep",
    "+callbacks.inf.step=1",
]


def _run(tmp_path, name, extra):
    cfg = compose_cfg([*BASE, *extra], run_dir=tmp_path / name)
    out = ddplab.run(cfg)
    return out, read_scalars(tmp_path / name / "tb")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_step_the_scaler_skips_changes_nothing_fused_or_not(tmp_path, optimizer):
    fused, fused_s = _run(tmp_path, "fused", [f"optimizer={optimizer}", "perf.fused_optimizer=auto"])
    plain, plain_s = _run(tmp_path, "plain", [f"optimizer={optimizer}", "perf.fused_optimizer=false"])
    for s in (fused_s, plain_s):
        skipped = [v for _, v in s["train/fp16_skipped_steps"]]
        assert skipped[0] == 1 and sum(skipped) == 1  # step 1 skipped, and only it
        assert s["vitals/loss_scale"][0][1] == 2.0**15  # halved once
        # The pre-clip norm averages the steps that updated: the skipped one's inf is left out, not logged.
        norms = s["train/grad_norm"]
        assert [st for st, _ in norms] == list(range(2, 23)) and all(
            math.isfinite(v) and v > 0 for _, v in norms
        )
    # The same training but for the kernels' rounding (fused and per-tensor kernels may differ in the last
    # bit; measured, SGD/AdamW: identical/rel 3.5e-6 on an EPYC CPU, rel 4.1e-5 for AdamW on an H100): at
    # most one of the 359 validation digits flips. Before the fix, fused SGD's loss was NaN by step 3.
    assert fused["val/loss"] == pytest.approx(plain["val/loss"], rel=1e-4)
    assert abs(fused["val/acc"] - plain["val/acc"]) * 359 <= 1 + 1e-9


def test_fused_sgd_under_the_scaler_starts_from_zero_momentum(tmp_path):
    """torch's fused SGD leaves the momentum buffer it makes at a skipped step uninitialized: ddplab gives it
    zeros, which the first real step turns into exactly the gradient, as unfused SGD does."""
    from functools import partial

    from ddplab.optim import make_optimizer

    p = torch.nn.Parameter(torch.ones(3))
    sgd = make_optimizer(partial(torch.optim.SGD, lr=0.1, momentum=0.9), [p], "auto", scaled=True)
    assert sgd.defaults["fused"] is True and torch.equal(sgd.state[p]["momentum_buffer"], torch.zeros(3))
    assert (
        "momentum_buffer"
        not in make_optimizer(partial(torch.optim.SGD, lr=0.1, momentum=0.9), [p], "auto").state[p]
    )  # no scaler: untouched
    damped = partial(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.1)
    assert not make_optimizer(damped, [p], "auto", scaled=True).defaults.get("fused")  # no zero start exists
    with pytest.raises(
        ValueError,
        match=r"perf.fused_optimizer=true with amp_dtype=float16: .* dampening.*"
        r"Fix: perf.fused_optimizer=auto",
    ):
        make_optimizer(damped, [p], "true", scaled=True)
