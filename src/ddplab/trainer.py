"""The loop, and only the loop: build the parts, train an epoch, evaluate, hand state to the checkpoints.

    step:  task(model, batch) under autocast → scaled backward (strategy.no_sync while accumulating)
           → unscale → clip → optimizer step → device-side metric sums
    every log interval: one collective (TrainMetrics.reduce) → rank-0 writer
    epoch: exact eval (one collective) → CheckpointManager.save

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
from ddplab.checkpoint.rng import RNGStreams, seed_everything
from ddplab.data.batches import map_tensors
from ddplab.evaluation import Evaluator, derived
from ddplab.metrics import TrainMetrics
from ddplab.optim import make_optimizer
from ddplab.perf import FlopRate
from ddplab.precision import Precision
from ddplab.callbacks import Callbacks, Hook
from ddplab.reporting import Progress, announce, run_summary, wrap
from ddplab.resuming import checkpoints_of, resume
from ddplab.runtime import collectives, env
from ddplab.runtime.group import DistState
from ddplab.runtime.signals import Preempted, StopSignal
from ddplab.runtime.stopping import StopAgreement, slow_save_warning
from ddplab.runtime.watch import StallWatch, default_store
from ddplab.state import State
from ddplab.task import check_batch, check_objective, check_output, name_of
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
        self.metrics = TrainMetrics(dist, getattr(s.task, "metric_names", ()), cfg.nonfinite_loss, s.accum,
                                    cfg.log_every_n_steps * s.accum)
        self._step_hooks = s.callbacks.hooks[Hook.ON_STEP_END]  # per step: an empty loop when none
        self._first_step_done = False
        self._bar = Progress("none", 0, 0, cfg.num_epochs)  # each epoch draws its own
        self.watch = StallWatch(dist.rank, dist.world_size, cfg.distributed.timeout_s, default_store())  # a hung peer gets said
        self.flops = FlopRate(s.strategy.counts_flops, s.module, dist.device, s.precision.dtype,
                              cfg.perf.peak_tflops, dist.world_size)  # counted on a batch in hand (_checked_step)

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
        scheduler = instantiate(cfg.scheduler, _convert_="all")(optimizer, total_steps=spe * cfg.num_epochs,
                                                                steps_per_epoch=spe)
        precision = Precision(cfg.amp, cfg.amp_dtype, dist.device)
        # Higher is better only for what the task says (accuracy); losses, errors, perplexity: lower.
        results = Results(minimize=cfg.objective.split("/", 1)[-1] not in getattr(task, "maximize", ()))
        rng = RNGStreams(dist)
        evaluator = Evaluator(task, module, data, dist, precision, strat, max(sampler.per_rank_batch, 256),
                              self._to_memory_format, cfg.get("limit_val_batches"))
        return State(cfg=cfg, dist=dist, run_dir=run_dir, task=task, strategy=strat, module=module, model=model,
                     params=params, optimizer=optimizer, scheduler=scheduler, precision=precision, data=data,
                     sampler=sampler, train_loader=loader, steps_per_epoch=spe, global_batch=global_batch,
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
        if loop.epoch >= cfg.num_epochs:
            log.info("already finished: %d of %d epochs done, nothing to train", loop.epoch, cfg.num_epochs)
        t0 = time.perf_counter()
        stop = cfg.stop_after_epochs or cfg.num_epochs
        try:
            if loop.eval_pending:  # stopped before its epoch-end evaluation: that runs first
                self._end_epoch()
            while loop.epoch < min(cfg.num_epochs, stop) and s.stop_reason is None:
                last_train = self.run_epoch() or last_train
            s.checkpoints.finish()  # async_save: the last checkpoint is on disk before the run says done
        except BaseException as e:
            s.checkpoints.drain()  # a checkpoint being written in the background is finished, not lost
            s.callbacks(Hook.ON_EXCEPTION, self.state, e)
            raise
        finally:
            self.watch.close()
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
        """One epoch: train, evaluate when due, checkpoint. Returns the last logged train metrics."""
        loop = self.state.loop
        last_train = self._train_epoch()
        loop.epoch += 1
        loop.step_in_epoch = loop.batches_in_epoch = 0
        loop.eval_pending = True
        if self.stopper.agreed:  # agreed in the epoch's last steps: its evaluation runs on resume
            self._preempt()
        self._end_epoch()
        return last_train

    def _end_epoch(self) -> None:
        """The epoch-end evaluation (when due) and checkpoint; a stop agreed during it saves and leaves."""
        s = self.state
        cfg, loop = s.cfg, s.loop
        improved = False
        if loop.epoch % cfg.eval_every_n_epochs == 0 or loop.epoch == cfg.num_epochs:
            val = self._evaluate_all(interruptible=True)
            if val is None:  # every rank agreed to stop mid-evaluation: it reruns on resume
                self._preempt()
            improved = s.results.update(val, cfg.objective, loop.epoch, loop.step)
            best = {} if s.results.best is None else {best_name(cfg.objective): s.results.best}
            s.writer.scalars({**val, **best, "vitals/epoch": loop.epoch}, loop.step)  # the best so far: a curve
            s.evaluator.visualize(s.writer, loop.step)
            for line in wrap(f"epoch {loop.epoch}/{cfg.num_epochs} ", [f"{k}={v:.4g}" for k, v in val.items()]):
                log.info("%s", line)
        loop.eval_pending = False
        self._save(is_best=improved)

    def _save(self, is_best: bool = False, mid_epoch: tuple[int, int] | None = None, now: bool = False) -> str:
        """A checkpoint now (``mid_epoch``: only if one is due now; the manager decides). The path or "".
        ``now``: on disk when this returns, even with checkpoint.async_save. The manager tells on_save."""
        s = self.state
        path = s.checkpoints.save(s.loop.step, is_best, mid_epoch, before=self._close_log_interval, now=now)
        if path:
            slow_save_warning(s.checkpoints.last_save_s, self.grace_s, f"checkpoint {Path(path).name}")
        return path

    def _close_log_interval(self) -> None:
        """Right before any checkpoint: the steps since the last log step are logged (none lost on
        resume), and the stall watch stops timing (a save is not a step)."""
        self.watch.pause()
        if self.metrics.steps:
            self._log()

    def _preempt(self) -> None:
        """Every rank agreed to stop here: checkpoint (written before leaving, async_save or not), then
        leave with status preempted."""
        raise Preempted(self.stopper.reason, self.state.loop.step, self._save(now=True))

    def _train_epoch(self) -> dict[str, float]:
        s, stopper = self.state, self.stopper
        cfg, loop = s.cfg, s.loop
        # Plain values, read once: a config node's attribute access costs microseconds per step.
        log_every, skip_nonfinite = cfg.log_every_n_steps, cfg.nonfinite_loss == "skip"
        s.model.train()
        spe = s.steps_per_epoch
        # New global permutation each epoch; after a mid-epoch resume, skip what was consumed.
        s.train_loader.set_epoch(loop.epoch, skip=loop.batches_in_epoch * s.accum)
        self._seed_epoch()
        self._bar = self._progress_bar()
        batches = iter(s.train_loader)
        t_step = time.perf_counter()
        self.watch.mark(loop.step + 1, t_step)
        try:
            for _ in range(spe - loop.batches_in_epoch):
                data_time = self._forward_backward(batches) if self._first_step_done else self._first_step(batches)
                loop.batches_in_epoch += 1  # consumed, whether or not the step below is taken
                if skip_nonfinite and self._skip_nonfinite_step():
                    continue
                self._optimizer_step()
                for hook in self._step_hooks:  # device-only work (EMA); none by default
                    hook(self.state, loop.step)
                now = time.perf_counter()
                self.metrics.add_step(now - t_step, data_time)
                t_step = now
                self.watch.mark(loop.step + 1, now)
                self._bar.update(1)
                # The stop agreement rides in a log step's collective, or in a tiny one about once a second.
                if loop.step % log_every == 0:
                    self._log()
                else:
                    stopper.after_step()
                if stopper.agreed and loop.batches_in_epoch < spe:  # at the epoch's end: run_epoch saves
                    self._preempt()
                if self._save(mid_epoch=(loop.batches_in_epoch, spe)):
                    t_step = time.perf_counter()
                    self.watch.mark(loop.step + 1, t_step)
            self.watch.pause()
            if self.metrics.steps:  # the epoch's tail since the last log step
                self._log()
        finally:
            self._bar.close()
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
        data_time, watch = 0.0, self.watch  # watch.phase: where a stalled step is, should one stall
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
            self.metrics.add_micro(out)
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
        self.flops.keep(batch)  # never the dataset: calling it would draw from the user's random streams
        return check_output(s.task, s.task(model, batch))

    def _optimizer_step(self) -> None:
        s = self.state
        self.watch.phase = "optimizer"
        norm = s.precision.step(s.optimizer, s.params, self.grad_clip)
        if norm is not None:
            self.metrics.add_grad_norm(s.strategy.grad_norm(norm))
        s.optimizer.zero_grad(set_to_none=True)
        s.scheduler.step()
        s.loop.step += 1
        s.loop.step_in_epoch += 1

    def _skip_nonfinite_step(self) -> bool:
        """nonfinite_loss=skip: drop this step on every rank if any rank's loss (any micro-batch) is NaN/Inf."""
        s = self.state
        bad = (~torch.isfinite(self.metrics.last_step_losses())).any()
        if not collectives.any_rank(bad, s.dist):  # sync + collective: skip mode's cost
            return False
        s.optimizer.zero_grad(set_to_none=True)
        self.metrics.skipped += 1
        log.warning("non-finite loss at step %d: step skipped (nonfinite_loss=skip)", s.loop.step + 1)
        return True

    def _log(self) -> dict[str, float]:
        s = self.state
        step = s.loop.step
        self.watch.phase = "log collective"
        # The one collective (and host sync) of this interval; it also carries this rank's stop request.
        values, anyone_stops = self.metrics.reduce(f"{self.position()}; task {name_of(s.task)}", step,
                                                   self.stopper.requested)
        self.stopper.heard_at_log_step(anyone_stops)
        values.update(derived(s.task, values, "train/"))
        if s.first_train_loss is None:  # the barely trained model's loss: the summary's yardstick
            s.first_train_loss = values.get("train/loss")
        s.callbacks(Hook.ON_LOG, self.state, values, step)
        values["vitals/lr"] = s.optimizer.param_groups[0]["lr"]
        values.update(self.flops.rates(values["vitals/samples_per_s"]))
        scale = s.precision.loss_scale()
        if scale is not None:
            values["vitals/loss_scale"] = scale
            values["train/fp16_skipped_steps"] = s.precision.pop_overflow_steps()  # not errors: the scaler's job
        s.writer.scalars(values, step)
        self._bar.show(s.loop.epoch, step, values)
        s.results.last_train = values
        return values

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
        val = self.state.evaluator.run(self.stopper if interruptible else None)
        if val is None:
            return None
        for extra in self.state.callbacks(Hook.ON_EVAL_END, self.state, val):
            val.update(extra or {})
        return val

    def _progress_bar(self) -> Progress:
        s = self.state
        return Progress.for_rank(str(s.cfg.progress), s.dist.is_main, s.steps_per_epoch, s.loop.epoch,
                                 s.cfg.num_epochs)
