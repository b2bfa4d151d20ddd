"""Optimizer and learning-rate schedule: the optimizer factory bound to the parameters
(fused kernels where possible), and the schedules conf/scheduler/*.yaml name.

Schedules are stepped once per optimizer step (not per epoch). Each factory is
a ``_partial_`` target; the trainer completes it with the optimizer and the
run's step counts, so a schedule means the same thing whatever the world size
or batch size.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import SGD, Optimizer
from torch.optim.lr_scheduler import LambdaLR

from ddplab import compat


def make_optimizer(
    factory: Callable[..., Optimizer], params: list[nn.Parameter], mode: Any, scaled: bool = False
) -> Optimizer:
    """``factory(params)`` with fused kernels per ``perf.fused_optimizer`` (auto | true | false).

    Fused: one kernel updates every parameter instead of a loop of small ops
    per tensor (about 3.6x faster for SGD with momentum on CPU, measured).
    Same update rule; results may differ in the last bit. ``scaled``: fp16's
    GradScaler will skip steps (see :func:`_safe_under_scaler`).
    """
    mode = str(mode).lower()
    if mode == "false":
        return factory(params)
    try:
        optimizer = factory(params, fused=True)
    except (TypeError, RuntimeError, ValueError) as e:  # no fused kernel for this optimizer/device/dtype
        if mode == "true":
            raise ValueError(
                f"perf.fused_optimizer=true, but this optimizer cannot run fused here ({e}). "
                "Fix: perf.fused_optimizer=auto"
            ) from e
        return factory(params)
    if not scaled or _safe_under_scaler(optimizer):
        return optimizer
    if mode == "true":
        raise ValueError(
            "perf.fused_optimizer=true with amp_dtype=float16: torch's fused SGD cannot skip a step "
            "with dampening != 0 (optimizer.dampening). Fix: perf.fused_optimizer=auto, "
            "optimizer.dampening=0 or amp_dtype=bfloat16"
        )
    return factory(params)


def _safe_under_scaler(optimizer: Optimizer) -> bool:
    """Whether fused ``optimizer`` survives the steps fp16's GradScaler skips, made so where it can be.

    torch's fused SGD (2.11-2.13 checked) makes a new momentum buffer with ``empty_like`` and then lets the
    kernel skip the step the scaler found inf in, so the buffer stays uninitialized memory and the next
    step writes ~1e35 or NaN into the weights; the scaler's first steps usually overflow, so fp16 training
    broke at step 3. A zero buffer gives the same first update (``0 * momentum + grad``) where dampening is
    0, and a skipped step leaves it zero. Fused Adam/AdamW keep their state untouched on a skipped step.
    """
    if not isinstance(optimizer, SGD):
        return True
    groups = [g for g in optimizer.param_groups if g["momentum"]]
    if any(g["dampening"] for g in groups):
        return False  # its first step is not `0 * momentum + (1 - dampening) * grad`
    for g in groups:
        for p in g["params"]:
            optimizer.state[p].setdefault(
                "momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format)
            )
    return True


def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps if step < warmup_steps else 1.0


def warmup_of(total_steps: int, warmup_steps: int, warmup_fraction: float | None) -> int:
    """The warmup in optimizer steps: ``warmup_fraction`` of the run's steps when given, else
    ``warmup_steps``."""
    return round(warmup_fraction * total_steps) if warmup_fraction is not None else warmup_steps


def cosine(
    optimizer: Optimizer,
    *,
    total_steps: int,
    steps_per_epoch: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.0,
    warmup_fraction: float | None = None,
) -> LambdaLR:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""
    warmup_steps = min(warmup_of(total_steps, warmup_steps, warmup_fraction), max(total_steps - 1, 0))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return _warmup(step, warmup_steps)
        progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def step(
    optimizer: Optimizer,
    *,
    total_steps: int,
    steps_per_epoch: int,
    step_epochs: int = 30,
    gamma: float = 0.1,
    warmup_steps: int = 0,
    warmup_fraction: float | None = None,
) -> LambdaLR:
    """Multiply the lr by ``gamma`` every ``step_epochs`` epochs (after warmup)."""
    warmup_steps = warmup_of(total_steps, warmup_steps, warmup_fraction)
    if step_epochs <= 0:
        raise ValueError(f"scheduler.step_epochs={step_epochs}: must be > 0")

    def factor(s: int) -> float:
        return _warmup(s, warmup_steps) * gamma ** (s // (step_epochs * steps_per_epoch))

    return LambdaLR(optimizer, factor)


def constant(
    optimizer: Optimizer,
    *,
    total_steps: int,
    steps_per_epoch: int,
    warmup_steps: int = 0,
    warmup_fraction: float | None = None,
) -> LambdaLR:
    warmup_steps = warmup_of(total_steps, warmup_steps, warmup_fraction)
    return LambdaLR(optimizer, lambda s: _warmup(s, warmup_steps))


def apply_hyperparameters(optimizer: Optimizer, scheduler: LambdaLR, fresh: list[dict[str, Any]]) -> None:
    """After loading a checkpoint: make the current config's optimizer values and schedule the ones in force.

    ``fresh``: the param groups (without ``params``) of the optimizer as the current config built
    it, taken before the checkpoint was loaded over them. Loading restores the saved lr,
    momentum, ... and the scheduler's base lrs; here the new ones replace them, and the lr of
    the step being resumed is recomputed from the new base lr and the (new) schedule, so a
    changed lr is used from the first resumed step. Momentum buffers and step counts stay.
    """
    for group, new in zip(optimizer.param_groups, fresh):
        group.update({k: v for k, v in new.items() if k != "lr"})
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    step = scheduler.last_epoch
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(step)
    compat.set_last_lr(scheduler, [g["lr"] for g in optimizer.param_groups])
