"""The loop, and only the loop, over a State that ``build_state`` made (``ddplab.train.assemble``).

    fit():         train_epoch until the RunLength (or a stop) ends the run; the summary
    train_epoch(): for each step: train_step → step hooks → LogInterval.after_step (→ stop agreed?)
                   → a step evaluation when due (eval_every_n_steps) or a checkpoint when due;
                   then the epoch's evaluation and checkpoint
    train_step():  accum × (autocast forward → backward, no_sync but the last) → unscale → clip → step
                   → zero_grad → schedule
    evaluate_checkpoint(): mode=eval: the resumed checkpoint's exact evaluation

What differs between none/dp/ddp/fsdp is the Strategy's; what a batch means is the Task's; what is saved
and when is the CheckpointManager's; how long the run is, the RunLength's; when an evaluation is due and what
it records, the Validation's; the log interval's bookkeeping (metrics, stop agreement, stall watch, progress,
FLOPs) and the step's data time and stall phases, the LogInterval's; the first step's checks, FirstStep's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator

from torch.nn.utils import clip_grad_norm_

from ddplab.runtime.signals import Preempted
from ddplab.runtime.stopping import StopAgreement, slow_save_warning
from ddplab.train.first_step import FirstStep
from ddplab.train.hooks import Hook
from ddplab.train.interval import LogInterval
from ddplab.train.reporting import announce, run_summary
from ddplab.train.state import State
from ddplab.train.validation import Validation

log = logging.getLogger("ddplab")


class Trainer:
    def __init__(self, state: State):
        self.state = s = state
        self.stopper = StopAgreement(s.stop, s.dist)  # every rank stops together (a signal, a dead launcher)
        # Read once: a config node's access costs microseconds, and these are read every step.
        self.grad_clip = float(s.cfg.grad_clip)
        self.skip_nonfinite = s.cfg.nonfinite_loss == "skip"
        self.interval = LogInterval(s, self.stopper)  # metrics, stop agreement, stall watch, progress, FLOPs
        self.probe = self.interval.probe  # the step's batches (timed), its task call, its gradients ready
        self.validation = Validation(s, self.stopper)  # when an evaluation is due; running and recording it
        self.first_step: FirstStep | None = FirstStep(s, self.interval)  # this invocation's first: checked
        self._step_hooks = s.callbacks.hooks[Hook.ON_STEP_END]  # per step: an empty loop when none

    # ------------------------------------------------------------------- the run
    def fit(self) -> dict[str, float]:
        """Train until the RunLength (or a stop) ends it; the final metrics."""
        s = self.state
        loop = s.loop
        announce(s)
        s.callbacks(Hook.ON_FIT_START, s)
        if s.length.done(loop.epoch, loop.step) and not loop.eval_pending:
            log.info(
                "already finished: %s done, nothing to train", s.length.describe_done(loop.epoch, loop.step)
            )
        t0 = time.perf_counter()
        last = s.cfg.stop_after_epochs or float("inf")  # (null: none; the schema refuses 0)
        try:
            if loop.eval_pending:  # stopped before an evaluation (an epoch's end, or a step's): it runs first
                self._evaluate_mid_epoch() if loop.batches_in_epoch else self._end_epoch()
            while not s.length.done(loop.epoch, loop.step) and loop.epoch < last and s.stop_reason is None:
                self.train_epoch()
            s.checkpoints.finish()  # async_save: the last checkpoint is on disk before the run says done
        except BaseException as e:
            s.checkpoints.drain()  # a checkpoint being written in the background is finished, not lost
            s.callbacks(Hook.ON_EXCEPTION, s, e)
            # what was queued for a tracking server is sent (within its timeout)
            with contextlib.suppress(Exception):
                self.stopper.hurry(s.writer, isinstance(e, Preempted))
                s.writer.drain()
            raise
        finally:
            self.interval.watch.close()
        return self._finish(time.perf_counter() - t0)

    def evaluate_checkpoint(self) -> dict[str, float]:
        """mode=eval: the resumed checkpoint's exact evaluation (and the callbacks', e.g. val_ema/*)."""
        s = self.state
        announce(s)
        val = self.validation.metrics()
        s.writer.scalars(val, s.loop.step)
        s.writer.close()
        log.info("evaluation of %s: %s", s.cfg.resume, "  ".join(f"{k}={v:.6g}" for k, v in val.items()))
        return {**val, "epoch": float(s.loop.epoch), "step": float(s.loop.step)}

    def _finish(self, seconds: float) -> dict[str, float]:
        """The run's metrics (the checkpoint's record when this invocation trained nothing), its summary."""
        s = self.state
        self.stopper.hurry(s.writer)
        s.writer.close()
        out = s.results.final(s.cfg.objective, s.loop, seconds)
        for line in run_summary(s, out):  # rank 0's last words: how it went, where things are
            log.info("%s", line)
        s.callbacks(Hook.ON_FIT_END, s, out)
        return out

    # ------------------------------------------------------------------- an epoch
    def train_epoch(self) -> None:
        """One epoch (after a mid-epoch resume: the rest of it), then its evaluation and checkpoint, unless
        it was cut short (max_steps, or early stopping at a step evaluation)."""
        self._epoch_steps()
        if self.state.loop.batches_in_epoch == self.state.steps_per_epoch:
            self._next_epoch()

    def _epoch_steps(self) -> None:
        """The epoch's steps from where the loop stands, each followed by the log interval and a step
        evaluation or a checkpoint when due."""
        s, iv = self.state, self.interval
        loop, spe = s.loop, s.steps_per_epoch
        s.model.train()
        # New global permutation each epoch; after a mid-epoch resume, skip what was consumed.
        s.train_loader.set_epoch(loop.epoch, skip=loop.batches_in_epoch * s.accum)
        s.rng.start_epoch(s.cfg.seed, loop.epoch, mid_epoch=loop.batches_in_epoch > 0)
        iv.new_bar()
        batches = self.probe.batches(iter(s.train_loader))
        iv.restart()
        try:
            while loop.batches_in_epoch < spe and not s.length.done(loop.epoch, loop.step):
                if not self._step(batches):  # nonfinite_loss=skip dropped it on every rank
                    continue
                for hook in self._step_hooks:  # device-only work (EMA); none by default
                    hook(s, loop.step)
                agreed = iv.after_step()
                at_end = loop.batches_in_epoch == spe  # the epoch's end: _next_epoch evaluates, saves, stops
                # saved with a stop
                loop.eval_pending = not at_end and self.validation.due(at_epoch_end=False)
                if agreed and not at_end:
                    self._preempt()
                if loop.eval_pending:
                    self._evaluate_mid_epoch()
                    if s.stop_reason is not None:  # early stopping decided at this evaluation
                        break
                elif self._save(mid_epoch=(loop.batches_in_epoch, spe)):
                    iv.restart()
            iv.close()  # the epoch's tail since the last log step
        finally:
            iv.bar.close()

    def _step(self, batches: Iterator[Any]) -> bool:
        if self.first_step is None:
            return self.train_step(batches)
        first, self.first_step = self.first_step, None
        stepped = first(self.train_step, batches)
        self.state.writer.open_soon()  # TensorBoard's import and file, beside the steps before the first log
        return stepped

    def train_step(self, batches: Iterator[Any]) -> bool:
        """One optimizer step of ``accum`` micro-batches; False: dropped (nonfinite_loss=skip, a NaN/Inf)."""
        s, probe, metrics = self.state, self.probe, self.interval.metrics
        for micro in range(s.accum):
            batch = s.memory_format(next(batches))
            # Gradients all-reduce in the last micro-batch's backward only.
            with s.strategy.no_sync(s.model) if micro < s.accum - 1 else contextlib.nullcontext():
                with s.precision.autocast():
                    out = probe.forward(s.model, batch)  # the task
                s.precision.backward(out.loss / s.accum if s.accum > 1 else out.loss)  # fp16: scaled
            metrics.add_micro(out)
        s.loop.batches_in_epoch += 1  # consumed, whether or not the update below is taken
        probe.gradients_ready()  # the first step's checks (FirstStep); nothing after
        if self.skip_nonfinite and self._drop_nonfinite():
            return False
        s.precision.unscale(s.optimizer)  # fp16: clip the real gradients, not the scaled ones
        if self.grad_clip > 0:  # the norm stays on the device until the next log step
            metrics.add_grad_norm(s.strategy.grad_norm(clip_grad_norm_(s.params, self.grad_clip)))
        s.precision.step(s.optimizer)  # fp16: skipped when a gradient is inf/nan
        s.optimizer.zero_grad(set_to_none=True)
        s.scheduler.step()
        s.loop.stepped()
        return True

    def _next_epoch(self) -> None:
        """An epoch's training is done: count it, then its evaluation and checkpoint (a stop agreed in its
        last steps saves first: the evaluation runs on resume)."""
        loop = self.state.loop
        loop.epoch += 1
        loop.step_in_epoch = loop.batches_in_epoch = 0
        loop.eval_pending = True
        if self.stopper.agreed:
            self._preempt()
        self._end_epoch()

    def _drop_nonfinite(self) -> bool:
        """nonfinite_loss=skip: a NaN/Inf loss on any rank drops this step, gradients too, on every rank."""
        if not self.interval.metrics.nonfinite_on_any_rank(self.state.loop.step + 1):
            return False
        self.state.optimizer.zero_grad(set_to_none=True)
        return True

    # ------------------------------------------------------------------- evaluations and checkpoints
    def _end_epoch(self) -> None:
        """The epoch-end evaluation (when due) and checkpoint; a stop agreed during it saves and leaves."""
        improved = self._evaluate() if self.validation.due(at_epoch_end=True) else False
        self.state.loop.eval_pending = False
        self._save(is_best=improved)

    def _evaluate_mid_epoch(self) -> None:
        """A step's evaluation (eval_every_n_steps, or the run's last step inside an epoch) and its
        checkpoint; training then goes on with the epoch's next batch. A stop agreed during it saves with the
        evaluation pending: the resumed run evaluates first, then trains on from the same batch."""
        s = self.state
        self.interval.close()
        improved = self._evaluate()
        s.loop.eval_pending = False
        self._save(is_best=improved)
        s.model.train()
        self.interval.restart()

    def _evaluate(self) -> bool:
        """The evaluation now due (a stop agreed in it: checkpoint, leave); True: the objective improved."""
        improved = self.validation.run()
        if improved is None:  # every rank agreed to stop mid-evaluation: it reruns on resume
            self._preempt()
        return bool(improved)

    def _save(
        self, is_best: bool = False, mid_epoch: tuple[int, int] | None = None, now: bool = False
    ) -> str:
        """A checkpoint now (``mid_epoch``: only if one is due now; the manager decides). The path or "".
        ``now``: on disk when this returns, even with checkpoint.async_save. The manager tells on_save."""
        s = self.state
        path = s.checkpoints.save(s.loop.step, is_best, mid_epoch, before=self.interval.close, now=now)
        if path:
            slow_save_warning(
                s.checkpoints.last_save_s, self.stopper.grace_s, f"checkpoint {Path(path).name}"
            )
        return path

    def _preempt(self) -> None:
        """Every rank agreed to stop here: checkpoint (written before leaving, async_save or not), then
        leave with status preempted."""
        raise Preempted(self.stopper.reason, self.state.loop.step, self._save(now=True))
