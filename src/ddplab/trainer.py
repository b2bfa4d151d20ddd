"""The loop, and only the loop: build the parts, train an epoch, evaluate, hand state to the checkpoints.

    step:  task(model, batch) under autocast → scaled backward (strategy.no_sync while accumulating)
           → unscale → clip → optimizer step → device-side metric sums
    every log interval: one collective (LogInterval: TrainMetrics.reduce) → rank-0 writer
    evaluation (epoch ends, or every eval_every_n_steps; the run's last step): exact (one collective)
           → CheckpointManager.save
    length: num_epochs, max_steps or the first of the two to end (RunLength)

What differs between none/dp/ddp/fsdp is the Strategy's; what a batch means is
the Task's; what is saved and when is the CheckpointManager's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from ddplab import build, rundir, strategy
from ddplab.batch_size import global_batch_size
from ddplab.checkpoint.rng import RNGStreams, seed_everything, streams_kept
from ddplab.data.batches import map_tensors
from ddplab.evaluation import Evaluator
from ddplab.interval import LogInterval
from ddplab.length import RunLength
from ddplab.optim import make_optimizer
from ddplab.precision import Precision
from ddplab.callbacks import Callbacks, Hook
from ddplab.reporting import announce, run_summary, wrap
from ddplab.resuming import checkpoints_of, resume
from ddplab.runtime import collectives, env
from ddplab.runtime.group import DistState
from ddplab.runtime.signals import Preempted, StopSignal
from ddplab.runtime.stopping import StopAgreement, slow_save_warning
from ddplab.state import State
from ddplab.task import check_batch, check_objective, check_output
from ddplab.trainstate import LoopState, Results, best_name
from ddplab.writers import make_writer

log = logging.getLogger("ddplab")


class Trainer:
    def __init__(self, cfg: DictConfig, dist: DistState, run_dir: Path, search_earlier_runs: bool = False,
                 stop: StopSignal | None = None, provenance: str | None = None):
        """``search_earlier_runs``: resume=auto may continue the newest earlier run of the same command
        (only for run dirs Hydra made up; see CheckpointManager.resume). ``stop``: the Session's
        preemption flag (a fresh, never-set one when None). ``provenance``: shown in TensorBoard's Text tab."""
        self.stop = stop or StopSignal()
        self.stopper = StopAgreement(self.stop, dist)  # when every rank stops together (a signal, a dead launcher)
        self.grace_s = env.launcher_grace_s()  # how long a launcher waits for a stopping rank (None: forever)
        self.eval_only = cfg.get("mode") == "eval"
        self.grad_clip = float(cfg.grad_clip)
        self.eval_every_n_steps = int(cfg.get("eval_every_n_steps") or 0)
        self.memory_format = torch.channels_last if cfg.perf.channels_last else None
        self.state = s = self._build(cfg, dist, run_dir, search_earlier_runs)
        self._step_fn = s.task  # the first step swaps in a checking wrapper (_first_step)
        s.callbacks(Hook.SETUP, s)
        self._check_objective()
        s.checkpoints, guard = checkpoints_of(s, stop=self.stop.request)
        s.config_changes = resume(s, guard)  # opted-in config changes applied, as text (or None)
        # The resumed run's last save: would a preemption's checkpoint be written within the launcher's grace?
        slow_save_warning(s.checkpoints.resumed_save_s, self.grace_s, "the last checkpoint of the resumed run")
        s.loop_start_step = s.loop.step  # where this invocation began (throughput in the summary)
        s.events_dir = rundir.events_dir(run_dir)  # tb/, or named after a sweep job's values
        # Steps after the checkpoint's were logged by an attempt that died: TensorBoard drops them. A run that
        # starts fresh where an attempt left events (killed before its first checkpoint) purges from step 1.
        earlier = s.loop.step or any(s.events_dir.glob("events.out.tfevents.*"))
        s.writer = make_writer(dist, str(s.events_dir), purge_step=s.loop.step + 1 if earlier else None)
        if provenance:
            s.writer.text("provenance", provenance)
        self.interval = LogInterval(s, self.stopper)  # metrics, stop agreement, stall watch, progress, FLOPs
        self._step_hooks = s.callbacks.hooks[Hook.ON_STEP_END]  # per step: an empty loop when none
        self._first_step_done = False

    def _build(self, cfg: DictConfig, dist: DistState, run_dir: Path, search_earlier_runs: bool) -> State:
        """The job's parts, in an order that fixes the random draws: same seed on every rank here, so
        identical initial weights and data order."""
        global_batch = global_batch_size(cfg, dist.world_size, exact=not self.eval_only)
        accum = cfg.grad_accum_steps
        seed_everything(cfg.seed)
        strat = strategy.make(cfg, dist)
        task = build.task(cfg)
        callbacks = Callbacks(build.callbacks(cfg, evaluating=self.eval_only))
        data, sampler, loader, spe = build.train_data(cfg, dist, global_batch, accum)
        # The unwrapped module: evaluation and checkpoints use it; the step calls the wrapped one.
        module = strat.prepare(build.model(cfg, data.num_classes))
        model = strat.wrap(module)
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = make_optimizer(instantiate(cfg.optimizer, _convert_="all"), params,
                                   strat.fused_mode(cfg.perf.fused_optimizer))
        length = RunLength(spe, cfg.num_epochs, cfg.get("max_steps"))
        scheduler = instantiate(cfg.scheduler, _convert_="all")(optimizer, total_steps=length.total_steps,
                                                                steps_per_epoch=spe)
        precision = Precision(cfg.amp, cfg.amp_dtype, dist.device)
        # Higher is better only for what the task says (accuracy); losses, errors, perplexity: lower.
        results = Results(minimize=cfg.objective.split("/", 1)[-1] not in getattr(task, "maximize", ()))
        rng = RNGStreams(dist)
        evaluator = Evaluator(task, module, data, dist, precision, strat, max(sampler.per_rank_batch, 256),
                              self._to_memory_format, cfg.get("limit_val_batches"))
        return State(cfg=cfg, dist=dist, run_dir=run_dir, task=task, strategy=strat, module=module, model=model,
                     params=params, optimizer=optimizer, scheduler=scheduler, precision=precision, data=data,
                     sampler=sampler, train_loader=loader, steps_per_epoch=spe, length=length, global_batch=global_batch,
                     accum=accum, loop=LoopState(seed=cfg.seed, accum=accum), results=results,
                     rng=rng, evaluator=evaluator, callbacks=callbacks,
                     search_earlier_runs=search_earlier_runs)

    def _check_objective(self) -> None:
        """The objective must be a metric the task logs: otherwise no best checkpoint is ever kept and sweepers get None."""
        s = self.state
        check_objective(s.cfg.objective, s.task, s.callbacks.logged_names())

    def position(self) -> str:
        return self.state.position()

    # ------------------------------------------------------------------- loop
    def run(self) -> tuple[dict[str, float], str | None, dict[str, Any] | None]:
        """Train (``mode=eval``: only evaluate). The metrics; why training stopped early, if it did; the
        objective with its direction (for sweep summaries)."""
        s = self.state
        if self.eval_only:
            metrics = self.evaluate_only()
            log.info("evaluation of %s: %s", s.cfg.resume, "  ".join(f"{k}={v:.6g}" for k, v in metrics.items()))
            return metrics, None, None
        return self.fit(), s.stop_reason, {"name": s.cfg.objective, "minimize": s.results.minimize}

    def fit(self) -> dict[str, float]:
        s = self.state
        cfg, loop = s.cfg, s.loop
        announce(self.state)
        s.callbacks(Hook.ON_FIT_START, self.state)
        last_train: dict[str, float] = {}
        if s.length.done(loop.epoch, loop.step) and not loop.eval_pending:
            done = (f"{loop.epoch} of {cfg.num_epochs} epochs" if cfg.get("max_steps") is None else
                    f"{loop.step} of {s.length.total_steps} steps")
            log.info("already finished: %s done, nothing to train", done)
        t0 = time.perf_counter()
        stop = cfg.stop_after_epochs
        try:
            if loop.eval_pending:  # stopped before an evaluation (an epoch's end, or a step's): that runs first
                self._evaluate_mid_epoch() if loop.batches_in_epoch else self._end_epoch()
            while not s.length.done(loop.epoch, loop.step) and (stop is None or loop.epoch < stop) \
                    and s.stop_reason is None:
                last_train = self.run_epoch() or last_train
            s.checkpoints.finish()  # async_save: the last checkpoint is on disk before the run says done
        except BaseException as e:
            s.checkpoints.drain()  # a checkpoint being written in the background is finished, not lost
            s.callbacks(Hook.ON_EXCEPTION, self.state, e)
            raise
        finally:
            self.interval.watch.close()
        best = s.results.best
        s.writer.close()
        # The checkpoint's record when this invocation trained nothing (resumed after the last step).
        out = {**(last_train or s.results.last_train), **s.results.last_val, "epoch": float(loop.epoch), "step": float(loop.step),
               "time_s": time.perf_counter() - t0}
        if best is not None:
            out[best_name(cfg.objective)] = best
        for line in run_summary(self.state, out):  # rank 0's last words: how it went, where things are
            log.info("%s", line)
        s.callbacks(Hook.ON_FIT_END, self.state, out)
        return out

    def evaluate_only(self) -> dict[str, float]:
        """mode=eval: the resumed checkpoint's exact evaluation (and the callbacks', e.g. val_ema/*)."""
        s = self.state
        announce(self.state)
        val = self._evaluate_all()
        s.writer.scalars(val, s.loop.step)
        s.writer.close()
        return {**val, "epoch": float(s.loop.epoch), "step": float(s.loop.step)}

    def run_epoch(self) -> dict[str, float]:
        """One epoch: train, evaluate when due, checkpoint. Returns the last logged train metrics. An epoch
        cut short (max_steps reached, or a stop requested at a step evaluation) ends at that evaluation."""
        loop = self.state.loop
        last_train = self._train_epoch()
        if loop.batches_in_epoch < self.state.steps_per_epoch:
            return last_train
        loop.epoch += 1
        loop.step_in_epoch = loop.batches_in_epoch = 0
        loop.eval_pending = True
        if self.stopper.agreed:  # agreed in the epoch's last steps: its evaluation runs on resume
            self._preempt()
        self._end_epoch()
        return last_train

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

    def _train_epoch(self) -> dict[str, float]:
        s, iv = self.state, self.interval
        loop, spe, length = s.loop, s.steps_per_epoch, s.length
        skip_nonfinite = s.cfg.nonfinite_loss == "skip"  # read once: a config node's access costs microseconds
        s.model.train()
        # New global permutation each epoch; after a mid-epoch resume, skip what was consumed.
        s.train_loader.set_epoch(loop.epoch, skip=loop.batches_in_epoch * s.accum)
        self._seed_epoch()
        iv.new_bar()
        batches = iter(s.train_loader)
        iv.restart()
        try:
            while loop.batches_in_epoch < spe and not length.done(loop.epoch, loop.step):
                data_time = self._forward_backward(batches) if self._first_step_done else self._first_step(batches)
                loop.batches_in_epoch += 1  # consumed, whether or not the step below is taken
                if skip_nonfinite and self._skip_nonfinite_step():
                    continue
                self._optimizer_step()
                for hook in self._step_hooks:  # device-only work (EMA); none by default
                    hook(s, loop.step)
                agreed = iv.after_step(data_time)
                at_end = loop.batches_in_epoch == spe  # the epoch's end: run_epoch evaluates, saves, stops
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
        return s.results.last_train

    def _seed_epoch(self) -> None:
        """Random streams for dropout/augmentation at the start of (a part of) an epoch."""
        s = self.state
        if s.loop.batches_in_epoch:
            s.rng.restore()  # mid-epoch resume: continue the saved streams exactly, if there are any
            return
        # Per-rank stream: differs between ranks and depends only on (seed, epoch, rank),
        # so a resumed run replays it.
        seed_everything(s.cfg.seed + 1_000_003 * (s.loop.epoch + 1) + s.dist.rank)

    def _forward_backward(self, batches: Iterator[Any]) -> float:
        """The micro-batches of one optimizer step; returns the time spent waiting for data."""
        s = self.state
        data_time, watch, metrics = 0.0, self.interval.watch, self.interval.metrics  # watch.phase: where a stall is
        for micro in range(s.accum):
            t = time.perf_counter()
            watch.phase = "data loading"
            batch = self._to_memory_format(next(batches))
            data_time += time.perf_counter() - t
            # Gradients all-reduce only on the last micro-batch of a step.
            with s.strategy.no_sync(s.model) if micro < s.accum - 1 else contextlib.nullcontext():
                watch.phase = "forward"
                with s.precision.autocast():
                    out = self._step_fn(s.model, batch)
                watch.phase = "backward"
                s.precision.backward(out.loss / s.accum if s.accum > 1 else out.loss)
            metrics.add_micro(out)
        return data_time

    def _first_step(self, batches: Iterator[Any]) -> float:
        """The first forward/backward: a model that cannot take the data's shapes fails here, said plainly."""
        s = self.state
        self._step_fn = self._checked_step
        try:
            data_time = self._forward_backward(batches)
        except RuntimeError as e:
            refusal = build.shape_mismatch(s.cfg, e)  # a model that cannot take the data: the config's fault
            if refusal is None:
                raise
            raise refusal from e
        self._step_fn = s.task
        self._first_step_done = True
        s.strategy.after_first_backward(s.module)
        return data_time

    def _checked_step(self, model: Any, batch: Any) -> Any:
        """The task's step with its batch and output checked (first step only: host metadata, no sync)."""
        s = self.state
        check_batch(s.task, batch)
        self.interval.keep(batch)  # never the dataset: calling it would draw from the user's random streams
        return check_output(s.task, s.task(model, batch))

    def _optimizer_step(self) -> None:
        s = self.state
        self.interval.watch.phase = "optimizer"
        norm = s.precision.step(s.optimizer, s.params, self.grad_clip)
        if norm is not None:
            self.interval.metrics.add_grad_norm(s.strategy.grad_norm(norm))
        s.optimizer.zero_grad(set_to_none=True)
        s.scheduler.step()
        s.loop.step += 1
        s.loop.step_in_epoch += 1

    def _skip_nonfinite_step(self) -> bool:
        """nonfinite_loss=skip: drop this step on every rank if any rank's loss (any micro-batch) is NaN/Inf."""
        s = self.state
        bad = (~torch.isfinite(self.interval.metrics.last_step_losses())).any()
        if not collectives.any_rank(bad, s.dist):  # sync + collective: skip mode's cost
            return False
        s.optimizer.zero_grad(set_to_none=True)
        self.interval.metrics.skipped += 1
        log.warning("non-finite loss at step %d: step skipped (nonfinite_loss=skip)", s.loop.step + 1)
        return True

    def _to_memory_format(self, batch: Any) -> Any:
        """Image batches (4-D float tensors) in the model's memory format (NHWC with perf.channels_last)."""
        fmt = self.memory_format
        if fmt is None:
            return batch
        return map_tensors(batch, lambda t: t.contiguous(memory_format=fmt) if t.dim() == 4 and t.is_floating_point()
                           else t)

    def _evaluate_all(self, interruptible: bool = False) -> dict[str, float] | None:
        """The evaluation plus what callbacks add to it (e.g. val_ema/*). ``interruptible``: None when
        every rank agreed to stop during it (a preemption signal)."""
        with streams_kept():  # evaluating never moves training's random streams
            val = self.state.evaluator.run(self.stopper if interruptible else None)
            if val is None:
                return None
            for extra in self.state.callbacks(Hook.ON_EVAL_END, self.state, val):
                val.update(extra or {})
        return val
