"""The trainer's own small records, each a Stateful checkpoint entry: where the loop is
(``loop``) and what the evaluations found (``results``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopState:
    """Optimizer steps and epochs completed, and the position inside the current epoch."""

    seed: int
    accum: int
    epoch: int = 0  # epochs completed (their training; see eval_pending)
    step: int = 0  # optimizer steps completed
    step_in_epoch: int = 0  # optimizer steps completed in the current epoch
    # Batch groups (accum micro-batches each) consumed in the current epoch: one per step, plus one per
    # step that nonfinite_loss=skip dropped. The data resumes from here, not from the step count.
    batches_in_epoch: int = 0
    eval_pending: bool = False  # stopped before the epoch-end evaluation: it runs first on resume

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "step_in_epoch": self.step_in_epoch,
                "batches_in_epoch": self.batches_in_epoch, "eval_pending": self.eval_pending,
                # The sampler needs no state of its own: (seed, epoch, position) fix its order.
                "sampler": {"seed": self.seed, "epoch": self.epoch,
                            "skip_micro_batches": self.batches_in_epoch * self.accum}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.step, self.step_in_epoch = sd["epoch"], sd["step"], sd.get("step_in_epoch", 0)
        self.batches_in_epoch = sd.get("batches_in_epoch", self.step_in_epoch)  # older checkpoints: no skips known
        self.eval_pending = sd.get("eval_pending", False)

    def position(self) -> str:
        return f"in epoch {self.epoch + 1}, step {self.step + 1}"


def best_name(objective: str) -> str:
    """Where the best value of ``objective`` is logged and returned: beside it (``val/acc_best``),
    so TensorBoard draws it in the objective's own group, right after it."""
    return f"{objective}_best"


@dataclass
class Results:
    """The latest validation metrics and the best value of the objective so far
    (higher is better, or lower with ``minimize``: a loss)."""

    minimize: bool = False
    best: float | None = None
    best_epoch: int = 0  # the epoch (1-based) and step of the best evaluation
    best_step: int = 0
    last_val: dict[str, float] = field(default_factory=dict)
    last_train: dict[str, float] = field(default_factory=dict)  # the last log step's train/* and vitals/*
    first_val: dict[str, float] = field(default_factory=dict)  # the run's first evaluation (for the summary)

    def update(self, val: dict[str, float], objective: str, epoch: int = 0, step: int = 0) -> bool:
        """Record an evaluation; True if it improved the objective."""
        self.last_val = val
        self.first_val = self.first_val or dict(val)
        obj = val.get(objective)
        if obj is not None and (self.best is None or (obj < self.best if self.minimize else obj > self.best)):
            self.best, self.best_epoch, self.best_step = obj, epoch, step
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "best_step": self.best_step,
                "last_val": self.last_val, "last_train": self.last_train, "first_val": self.first_val}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.best, self.last_val = sd["best"], sd.get("last_val", {})
        self.best_epoch, self.best_step = sd.get("best_epoch", 0), sd.get("best_step", 0)
        self.first_val = sd.get("first_val", {})
        # Kept in the checkpoint so that a run resumed after its last step (or its last evaluation)
        # still reports what its training measured (result.json must not lose train/*).
        self.last_train = sd.get("last_train", {})
