"""When the loop evaluates, and the evaluation as the loop records it (torchtitan's validator is the model).

:meth:`Validation.due` says whether one is due: the run's last step always; else every
``eval_every_n_steps`` optimizer steps (mid-epoch too), or at the end of every ``eval_every_n_epochs``-th
epoch. :meth:`Validation.run` runs it: the Evaluator's exact pass and what callbacks add (``val_ema/*``),
recorded (the bests), drawn and said. One stopped by a signal (every rank agreed) returns None: the loop
checkpoints with the evaluation pending (``loop.eval_pending``), and the resumed run evaluates first.
"""

from __future__ import annotations

import logging

from ddplab.checkpoint.rng import streams_kept
from ddplab.runtime.stopping import StopAgreement
from ddplab.train.hooks import Hook
from ddplab.train.reporting import wrap
from ddplab.train.state import State, best_name

log = logging.getLogger("ddplab")


class Validation:
    def __init__(self, state: State, stopper: StopAgreement):
        self.state, self.stopper = state, stopper
        self.step_cadence = int(state.cfg.eval_every_n_steps)  # 0: the epochs' cadence

    def due(self, at_epoch_end: bool) -> bool:
        s = self.state
        loop = s.loop
        if s.length.done(loop.epoch, loop.step):  # the run's last step is always evaluated
            return True
        if self.step_cadence:  # a step cadence replaces the epochs'
            return loop.step % self.step_cadence == 0
        return at_epoch_end and loop.epoch % s.cfg.eval_every_n_epochs == 0

    def run(self) -> bool | None:
        """Evaluate, record, draw and say it: whether the objective improved (None: every rank agreed to stop
        during it; nothing recorded)."""
        s = self.state
        cfg, loop = s.cfg, s.loop
        val = self.metrics(interruptible=True)
        if val is None:
            return None
        improved = s.results.update(val, cfg.objective, loop.epoch, loop.step)
        best = {} if s.results.best is None else {best_name(cfg.objective): s.results.best}
        # a step evaluation: part-way through one
        epoch = loop.epoch + loop.batches_in_epoch / s.steps_per_epoch
        s.writer.scalars({**val, **best, "vitals/epoch": epoch}, loop.step)  # the best so far: a curve
        s.evaluator.visualize(s.writer, loop.step)
        head = (
            f"step {loop.step}/{s.length.total_steps} "
            if self.step_cadence or loop.batches_in_epoch
            else f"epoch {loop.epoch}/{s.length.epochs} "
        )
        for line in wrap(head, [f"{k}={v:.4g}" for k, v in val.items()]):
            log.info("%s", line)
        return improved

    def metrics(self, interruptible: bool = False) -> dict[str, float] | None:
        """The evaluation plus what callbacks add to it (e.g. val_ema/*). ``interruptible``: None when
        every rank agreed to stop during it (a preemption signal)."""
        s = self.state
        with streams_kept():  # evaluating never moves training's random streams
            val = s.evaluator.evaluate(self.stopper if interruptible else None)
            if val is None:
                return None
            for extra in s.callbacks(Hook.ON_EVAL_END, s, val):
                val.update(extra or {})
        return val
