"""Schemas of the optimizer and scheduler groups (conf/optimizer, conf/scheduler); ddplab.config.groups lists
them.

A scheduler's factory (ddplab.optim) gets the run's optimizer steps (``total_steps``: num_epochs, max_steps or
the first of the two to end) and the steps per epoch; its warmup is ``warmup_steps``, or ``warmup_fraction``
of the run's steps when that is set (the same steps at any world size: a step is one of the global batch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ddplab.config.errors import require


def _check_warmup(c: Any, key: str) -> None:
    require(
        c.warmup_steps >= 0,
        f"{key}.warmup_steps",
        c.warmup_steps,
        "must be >= 0",
        f"pass {key}.warmup_steps=0",
    )
    f = c.get("warmup_fraction")
    require(
        f is None or 0 <= f < 1,
        f"{key}.warmup_fraction",
        f,
        "must be in [0, 1) (a fraction of the run's steps)",
        f"pass {key}.warmup_fraction=0.05, or null to use {key}.warmup_steps",
    )


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True  # bound to the model's parameters by the trainer
    lr: float = 0.1  # the peak learning rate (the schedule scales it)
    momentum: float = 0.9  # heavy-ball momentum
    weight_decay: float = 5e-4  # L2 penalty, added to the gradient
    nesterov: bool = True  # Nesterov's look-ahead momentum


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 1e-3  # the peak learning rate (the schedule scales it)
    # decay of the gradient's 1st and 2nd moments
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01  # decoupled from the gradient (AdamW's)
    eps: float = 1e-8  # added to the second moment's root


@dataclass
class CosineConfig:
    """Linear warmup, then cosine decay to min_lr_ratio * lr over all optimizer steps."""

    _target_: str = "ddplab.optim.cosine"
    _partial_: bool = True
    warmup_steps: int = 20  # optimizer steps of linear warmup from lr/warmup_steps
    # e.g. 0.05: warm up over 5% of the run's steps (warmup_steps ignored)
    warmup_fraction: Optional[float] = None
    min_lr_ratio: float = 0.0  # final lr = min_lr_ratio * lr

    @staticmethod
    def check(c: Any, key: str) -> None:
        _check_warmup(c, key)
        require(
            0 <= c.min_lr_ratio <= 1,
            f"{key}.min_lr_ratio",
            c.min_lr_ratio,
            "must be in [0, 1] (the final lr as a fraction of optimizer.lr)",
            f"pass {key}.min_lr_ratio=0.01",
        )


@dataclass
class StepConfig:
    _target_: str = "ddplab.optim.step"
    _partial_: bool = True
    step_epochs: int = 30  # multiply the lr by gamma every step_epochs epochs
    gamma: float = 0.1  # the factor, each step_epochs epochs
    warmup_steps: int = 0  # optimizer steps of linear warmup
    # e.g. 0.05: warm up over 5% of the run's steps (warmup_steps ignored)
    warmup_fraction: Optional[float] = None

    @staticmethod
    def check(c: Any, key: str) -> None:
        _check_warmup(c, key)
        require(
            c.step_epochs > 0,
            f"{key}.step_epochs",
            c.step_epochs,
            "must be > 0",
            f"pass {key}.step_epochs=30",
        )
        require(c.gamma > 0, f"{key}.gamma", c.gamma, "must be > 0", f"pass {key}.gamma=0.1")


@dataclass
class ConstantConfig:
    _target_: str = "ddplab.optim.constant"
    _partial_: bool = True
    warmup_steps: int = 0  # optimizer steps of linear warmup, then lr
    # e.g. 0.05: warm up over 5% of the run's steps (warmup_steps ignored)
    warmup_fraction: Optional[float] = None

    check = staticmethod(_check_warmup)
