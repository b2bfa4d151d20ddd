"""The first step of each invocation, checked: what would otherwise fail later, cryptically, fails at step 1
naming its cause.

* each batch and the task's output (:func:`ddplab.task.check_batch`, :func:`ddplab.task.check_output`: host
  metadata, no sync), and the first batch kept for the FLOP count and the tokens per sample;
* after the backward, the strategy's look at which parameters got a gradient (DDP: all must), whether the step
  then updates or is dropped (nonfinite_loss=skip, fp16's scaler): the next step's forward would fail on it;
* a model that cannot take the data's shapes: said plainly (:func:`ddplab.build.shape_mismatch`).

The checks go into the step's probe for this one step (:class:`ddplab.train.interval.StepProbe`); the step
itself is the Trainer's ``train_step``, the same for every step.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from ddplab import build
from ddplab.task import check_batch, check_output
from ddplab.train.interval import LogInterval
from ddplab.train.state import State


class FirstStep:
    def __init__(self, state: State, interval: LogInterval):
        self.state, self.interval = state, interval

    def __call__(self, train_step: Callable[[Iterator[Any]], bool], batches: Iterator[Any]) -> bool:
        s, probe = self.state, self.interval.probe
        updating: list[bool] = []
        hook = s.optimizer.register_step_pre_hook(lambda *_: updating.append(True))
        try:
            with probe.checked(self._checked_task, self._gradients_checked):
                return train_step(batches)
        except RuntimeError as e:
            # the config's fault: a model the data
            refusal = None if updating else build.shape_mismatch(s.cfg, e)
            if refusal is None:  # cannot go through
                raise
            raise refusal from e
        finally:
            hook.remove()

    def _checked_task(self, model: Any, batch: Any) -> Any:
        task = self.state.task
        check_batch(task, batch)
        self.interval.keep(batch)  # never the dataset: calling it would draw from the user's random streams
        return check_output(task, task(model, batch))

    def _gradients_checked(self) -> None:
        s = self.state
        s.strategy.after_first_backward(s.module)
