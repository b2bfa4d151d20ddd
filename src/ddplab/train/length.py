"""How long a run trains, in optimizer steps: ``num_epochs``, ``max_steps``, or both (whichever ends first).

The learning-rate schedule spans :attr:`RunLength.total_steps`; the loop stops at :meth:`RunLength.done`; the
start-up line and the summary say which of the two set the length. Steps count optimizer steps of the global
batch, so a length means the same at any world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RunLength:
    steps_per_epoch: int  # optimizer steps per epoch (limit_train_steps applied)
    num_epochs: int | None
    max_steps: int | None

    @property
    def total_steps(self) -> int:
        """The optimizer steps the run trains (a step that nonfinite_loss=skip drops is not one)."""
        by_epochs = self.steps_per_epoch * self.num_epochs if self.num_epochs is not None else None
        return min(n for n in (by_epochs, self.max_steps) if n is not None)

    @property
    def epochs(self) -> int:
        """Epochs the run starts (the last one possibly cut short by max_steps)."""
        return math.ceil(self.total_steps / self.steps_per_epoch)

    @property
    def by_steps(self) -> bool:
        """max_steps sets the length (given, and reached before num_epochs ends)."""
        return (
            self.max_steps is not None
            and self.total_steps == self.max_steps
            and (self.num_epochs is None or self.max_steps < self.steps_per_epoch * self.num_epochs)
        )

    def done(self, epoch: int, step: int) -> bool:
        """Training is over after ``epoch`` epochs and ``step`` optimizer steps."""
        return (self.num_epochs is not None and epoch >= self.num_epochs) or (
            self.max_steps is not None and step >= self.max_steps
        )

    def describe(self) -> str:
        """The start-up line's length: which key set it, and the other's length when both were given."""
        spe = f"{self.steps_per_epoch:,} steps/epoch"
        if self.max_steps is None:
            return f"{spe} x {self.num_epochs} epochs"
        if self.num_epochs is None:
            epochs = self.max_steps / self.steps_per_epoch
            return f"{self.max_steps:,} steps (max_steps; {spe}, {epochs:.3g} epochs)"
        by_epochs = self.steps_per_epoch * self.num_epochs
        if self.by_steps:
            return (
                f"{self.max_steps:,} steps (max_steps ends first; num_epochs={self.num_epochs} would be "
                f"{by_epochs:,}; {spe})"
            )
        return (
            f"{spe} x {self.num_epochs} epochs = {by_epochs:,} steps (num_epochs ends before "
            f"max_steps={self.max_steps:,}; "
            "num_epochs=null trains by steps alone)"
        )

    def describe_done(self, epoch: int, step: int) -> str:
        """How much of it is done, in the unit the config gave (epochs unless max_steps was given)."""
        if self.max_steps is None:
            return f"{epoch} of {self.num_epochs} epochs"
        return f"{step} of {self.total_steps} steps"
