"""The loop, and only the loop, over a State that ``build_state`` made (``ddplab.train.assemble``).

    train():       train_epoch until the RunLength (or a stop) ends the run; the summary
    train_epoch(): for each step: train_step → step hooks → LogInterval.after_step (→ stop agreed?)
                   → a step evaluation when due (eval_every_n_steps) or a checkpoint when due;
                   then the epoch's evaluation and checkpoint
    train_step():  accum × (autocast forward → backward, no_sync but the last) → unscale → clip → step
                   → zero_grad → schedule
    evaluate():    mode=eval: the resumed checkpoint's exact evaluation

What differs between none/dp/ddp/fsdp is the Strategy's; what a batch means is the Task's; what is saved
and when is the CheckpointManager's; how long the run is, the RunLength's; the log interval's bookkeeping
(metrics, stop agreement, stall watch, progress, FLOPs), the LogInterval's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.nn.utils import clip_grad_norm_

from ddplab import build
from ddplab.train.hooks import Hook
from ddplab.checkpoint.rng import seed_everything, streams_kept
from ddplab.train.reporting import announce, run_summary, wrap
from ddplab.runtime import collectives, env
from ddplab.runtime.signals import Preempted
from ddplab.runtime.stopping import StopAgreement, slow_save_warning
from ddplab.task import check_batch, check_output
from ddplab.train.interval import LogInterval
from ddplab.train.state import State, best_name

log = logging.getLogger("ddplab")
EXIT_MARGIN_S = 5.0  # of the launcher's grace, kept for the exit itself after a tracker's last sends


class Trainer:
    def __init__(self, state: State):
        self.state = s = state
        self.stopper = StopAgreement(s.stop, s.dist)  # when every rank stops together (a signal, a dead launcher)
        self.grace_s = env.launcher_grace_s()  # how long a launcher waits for a stopping rank (None: forever)
        # Read once: a config node's access costs microseconds, and these are read every step.
        self.grad_clip = float(s.cfg.grad_clip)
        self.skip_nonfinite = s.cfg.nonfinite_loss == "skip"
        self.eval_every_n_steps = int(s.cfg.get("eval_every_n_steps") or 0)
        self.interval = LogInterval(s, self.stopper)  # metrics, stop agreement, stall watch, progress, FLOPs
        self.step_fn = self._checked_step  # the task, checked on the first step (then s.task itself)
        self.after_backward = self._first_backward  # every micro-batch's backward done (then nothing)
        self._step_hooks = s.callbacks.hooks[Hook.ON_STEP_END]  # per step: an empty loop when none

    # ------------------------------------------------------------------- the run
    def train(self) -> dict[str, float]:
        """Train until the RunLength (or a stop) ends it; the final metrics."""
        s = self.state
        loop = s.loop
        announce(s)
        s.callbacks(Hook.ON_FIT_START, s)
        if s.length.done(loop.epoch, loop.step) and not loop.eval_pending:
            log.info("already finished: %s done, nothing to train", s.length.describe_done(loop.epoch, loop.step))
        t0 = time.perf_counter()
        stop = s.cfg.stop_after_epochs
        try:
            if loop.eval_pending:  # stopped before an evaluation (an epoch's end, or a step's): that runs first
                self._evaluate_mid_epoch() if loop.batches_in_epoch else self._end_epoch()
            while not s.length.done(loop.epoch, loop.step) and (stop is None or loop.epoch < stop) \
                    and s.stop_reason is None:
                self.train_epoch()
            s.checkpoints.finish()  # async_save: the last checkpoint is on disk before the run says done
        except BaseException as e:
            s.checkpoints.drain()  # a checkpoint being written in the background is finished, not lost
            s.callbacks(Hook.ON_EXCEPTION, s, e)
            with contextlib.suppress(Exception):  # what was queued for a tracking server is sent (within its timeout)
                self._hurry_writer(isinstance(e, Preempted))
                s.writer.drain()
            raise
        finally:
            self.interval.watch.close()
        return self._finish(time.perf_counter() - t0)

    def _hurry_writer(self, stopped: bool = False) -> None:
        """After a stop signal (this rank's, or a peer's the ranks ``stopped`` on) the launcher's grace bounds the
        job's end (``env.launcher_grace_s``; none known: no one kills the job, nothing to hurry): the checkpoint
        came first, and a tracking server still being sent to gets what is left of it but EXIT_MARGIN_S (a dead
        server otherwise held the exit for ``mlflow.close_timeout_s``, past the grace)."""
        s = self.state
        if self.grace_s is not None and (stopped or s.stop.requested):
            since = time.monotonic() - s.stop.at if s.stop.requested else 0.0
            s.writer.hurry(max(1.0, self.grace_s - since - EXIT_MARGIN_S))

    def evaluate(self) -> dict[str, float]:
        """mode=eval: the resumed checkpoint's exact evaluation (and the callbacks', e.g. val_ema/*)."""
        s = self.state
        announce(s)
        val = self._evaluate_all()
        s.writer.scalars(val, s.loop.step)
        s.writer.close()
        log.info("evaluation of %s: %s", s.cfg.resume, "  ".join(f"{k}={v:.6g}" for k, v in val.items()))
        return {**val, "epoch": float(s.loop.epoch), "step": float(s.loop.step)}

    def _finish(self, seconds: float) -> dict[str, float]:
        """The run's metrics (the checkpoint's record when this invocation trained nothing), its summary."""
        s = self.state
        self._hurry_writer()
        s.writer.close()
        res, loop = s.results, s.loop
        out = {**res.last_train, **res.last_val, "epoch": float(loop.epoch), "step": float(loop.step),
               "time_s": seconds}
        if res.best is not None:
            out[best_name(s.cfg.objective)] = res.best
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
        self._seed_epoch()
        iv.new_bar()
        batches = iter(s.train_loader)
        iv.restart()
        try:
            while loop.batches_in_epoch < spe and not s.length.done(loop.epoch, loop.step):
                data_time = self.train_step(batches) if self.step_fn is s.task else self._first_step(batches)
                if data_time is None:  # nonfinite_loss=skip dropped it on every rank
                    continue
                for hook in self._step_hooks:  # device-only work (EMA); none by default
                    hook(s, loop.step)
                agreed = iv.after_step(data_time)
                at_end = loop.batches_in_epoch == spe  # the epoch's end: _next_epoch evaluates, saves, stops
                loop.eval_pending = not at_end and self._eval_due(at_epoch_end=False)  # saved with a stop
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

    def train_step(self, batches: Iterator[Any]) -> float | None:
        """One optimizer step of ``accum`` micro-batches: seconds spent waiting for data (None: skipped, NaN/Inf)."""
        s, watch, metrics = self.state, self.interval.watch, self.interval.metrics  # watch.phase: where a stall is
        data_time = 0.0
        for micro in range(s.accum):
            t = time.perf_counter()
            watch.phase = "data loading"
            batch = s.memory_format(next(batches))
            data_time += time.perf_counter() - t
            # Gradients all-reduce in the last micro-batch's backward only.
            with s.strategy.no_sync(s.model) if micro < s.accum - 1 else contextlib.nullcontext():
                watch.phase = "forward"
                with s.precision.autocast():
                    out = self.step_fn(s.model, batch)
                watch.phase = "backward"
                s.precision.backward(out.loss / s.accum if s.accum > 1 else out.loss)  # fp16: scaled
            metrics.add_micro(out)
        s.loop.batches_in_epoch += 1  # consumed, whether or not the update below is taken
        self.after_backward()
        if self.skip_nonfinite and self._nonfinite_on_any_rank():
            return None
        watch.phase = "optimizer"
        s.precision.unscale(s.optimizer)  # fp16: clip the real gradients, not the scaled ones
        if self.grad_clip > 0:  # the norm stays on the device until the next log step
            metrics.add_grad_norm(s.strategy.grad_norm(clip_grad_norm_(s.params, self.grad_clip)))
        s.precision.step(s.optimizer)  # fp16: skipped when a gradient is inf/nan
        s.optimizer.zero_grad(set_to_none=True)
        s.scheduler.step()
        s.loop.stepped()
        return data_time

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

    def _seed_epoch(self) -> None:
        """Random streams for dropout/augmentation at the start of (a part of) an epoch."""
        s = self.state
        if s.loop.batches_in_epoch:
            s.rng.restore()  # mid-epoch resume: continue the saved streams exactly, if there are any
            return
        # Per-rank stream: differs between ranks and depends only on (seed, epoch, rank), so a resumed run
        # replays it.
        seed_everything(s.cfg.seed + 1_000_003 * (s.loop.epoch + 1) + s.dist.rank)

    def _first_step(self, batches: Iterator[Any]) -> float | None:
        """The first step: its batch and the task's output checked, and after its backward the strategy's look
        at which parameters got a gradient (DDP: all must), whether the step then updates or is dropped
        (nonfinite_loss=skip, fp16's scaler): the next step's forward would fail on it cryptically. A model
        that cannot take the data's shapes fails here, said plainly."""
        s = self.state
        updating: list[bool] = []
        hook = s.optimizer.register_step_pre_hook(lambda *_: updating.append(True))
        try:
            data_time = self.train_step(batches)
        except RuntimeError as e:
            refusal = None if updating else build.shape_mismatch(s.cfg, e)  # the config's fault: a model the data
            if refusal is None:                                             # cannot go through
                raise
            raise refusal from e
        finally:
            hook.remove()
        self.step_fn = s.task  # later steps call the task itself
        return data_time

    def _first_backward(self) -> None:
        s = self.state
        s.strategy.after_first_backward(s.module)
        self.after_backward = _nothing


    def _checked_step(self, model: Any, batch: Any) -> Any:
        """The task's step with its batch and output checked (host metadata, no sync)."""
        s = self.state
        check_batch(s.task, batch)
        self.interval.keep(batch)  # never the dataset: calling it would draw from the user's random streams
        return check_output(s.task, s.task(model, batch))

    def _nonfinite_on_any_rank(self) -> bool:
        """nonfinite_loss=skip: drop this step on every rank if any rank's loss (any micro-batch) is NaN/Inf."""
        s, metrics = self.state, self.interval.metrics
        bad = (~torch.isfinite(metrics.last_step_losses())).any()
        if not collectives.any_rank(bad, s.dist):  # sync + collective: skip mode's cost
            return False
        s.optimizer.zero_grad(set_to_none=True)
        metrics.skipped += 1
        log.warning("non-finite loss at step %d: step skipped (nonfinite_loss=skip)", s.loop.step + 1)
        return True

    # ------------------------------------------------------------------- evaluations and checkpoints
    def _end_epoch(self) -> None:
        """The epoch-end evaluation (when due) and checkpoint; a stop agreed during it saves and leaves."""
        improved = self._evaluate_and_record() if self._eval_due(at_epoch_end=True) else False
        self.state.loop.eval_pending = False
        self._save(is_best=improved)

    def _evaluate_mid_epoch(self) -> None:
        """A step's evaluation (eval_every_n_steps, or the run's last step inside an epoch) and its checkpoint;
        training then goes on with the epoch's next batch. A stop agreed during it saves with the evaluation
        pending: the resumed run evaluates first, then trains on from the same batch."""
        s = self.state
        self.interval.close()
        improved = self._evaluate_and_record()
        s.loop.eval_pending = False
        self._save(is_best=improved)
        s.model.train()
        self.interval.restart()

    def _eval_due(self, at_epoch_end: bool) -> bool:
        s = self.state
        loop = s.loop
        if s.length.done(loop.epoch, loop.step):  # the run's last step is always evaluated
            return True
        if self.eval_every_n_steps:  # a step cadence replaces the epochs'
            return loop.step % self.eval_every_n_steps == 0
        return at_epoch_end and loop.epoch % s.cfg.eval_every_n_epochs == 0

    def _evaluate_and_record(self) -> bool:
        """Evaluate (a stop agreed during it: checkpoint and leave), record, draw and say it; True if the
        objective improved."""
        s = self.state
        cfg, loop = s.cfg, s.loop
        val = self._evaluate_all(interruptible=True)
        if val is None:  # every rank agreed to stop mid-evaluation: it reruns on resume
            self._preempt()
        improved = s.results.update(val, cfg.objective, loop.epoch, loop.step)
        best = {} if s.results.best is None else {best_name(cfg.objective): s.results.best}
        epoch = loop.epoch + loop.batches_in_epoch / s.steps_per_epoch  # a step evaluation: part-way through one
        s.writer.scalars({**val, **best, "vitals/epoch": epoch}, loop.step)  # the best so far: a curve
        s.evaluator.visualize(s.writer, loop.step)
        head = (f"step {loop.step}/{s.length.total_steps} " if self.eval_every_n_steps or loop.batches_in_epoch
                else f"epoch {loop.epoch}/{s.length.epochs} ")
        for line in wrap(head, [f"{k}={v:.4g}" for k, v in val.items()]):
            log.info("%s", line)
        return improved

    def _evaluate_all(self, interruptible: bool = False) -> dict[str, float] | None:
        """The evaluation plus what callbacks add to it (e.g. val_ema/*). ``interruptible``: None when
        every rank agreed to stop during it (a preemption signal)."""
        with streams_kept():  # evaluating never moves training's random streams
            val = self.state.evaluator.evaluate(self.stopper if interruptible else None)
            if val is None:
                return None
            for extra in self.state.callbacks(Hook.ON_EVAL_END, self.state, val):
                val.update(extra or {})
        return val

    def _save(self, is_best: bool = False, mid_epoch: tuple[int, int] | None = None, now: bool = False) -> str:
        """A checkpoint now (``mid_epoch``: only if one is due now; the manager decides). The path or "".
        ``now``: on disk when this returns, even with checkpoint.async_save. The manager tells on_save."""
        s = self.state
        path = s.checkpoints.save(s.loop.step, is_best, mid_epoch, before=self.interval.close, now=now)
        if path:
            slow_save_warning(s.checkpoints.last_save_s, self.grace_s, f"checkpoint {Path(path).name}")
        return path

    def _preempt(self) -> None:
        """Every rank agreed to stop here: checkpoint (written before leaving, async_save or not), then
        leave with status preempted."""
        raise Preempted(self.stopper.reason, self.state.loop.step, self._save(now=True))


def _nothing() -> None:
    """Trainer.after_backward after the first step."""
