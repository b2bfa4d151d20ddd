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
import re
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from ddplab import build, rundir, strategy
from ddplab.batch_size import global_batch_size
from ddplab.checkpoint.rng import RNGStreams, seed_everything
from ddplab.config import ConfigError
from ddplab.data.batches import first_tensor, map_tensors
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
from ddplab.task import check_batch, check_output, logged_names, name_of
from ddplab.trainstate import LoopState, Results, best_name
from ddplab.writers import make_writer

log = logging.getLogger("ddplab")
# torch's words for a model/input shape mismatch (conv kernels, matmuls, reshapes).
_SHAPE_ERROR = re.compile(r"size|shape|kernel|mat1|dimension", re.IGNORECASE)


class Trainer:
    def __init__(self, cfg: DictConfig, state: DistState, run_dir: Path, search_earlier_runs: bool = False,
                 stop: StopSignal | None = None):
        """``search_earlier_runs``: resume=auto may continue the newest earlier run of the same command
        (only for run dirs Hydra made up; see CheckpointManager.resume). ``stop``: the Session's
        preemption flag (a fresh, never-set one when None)."""
        self.cfg, self.state, self.run_dir = cfg, state, run_dir
        self.stop = stop or StopSignal()
        self.stopper = StopAgreement(self.stop, state)  # when every rank stops together (a signal, a dead launcher)
        self.grace_s = env.launcher_grace_s()  # how long a launcher waits for a stopping rank (None: forever)
        self.search_earlier_runs = search_earlier_runs
        self.eval_only = cfg.get("mode") == "eval"
        self.global_batch = global_batch_size(cfg, state.world_size, exact=not self.eval_only)
        self.accum = cfg.grad_accum_steps
        self.samples_per_step = self.global_batch * self.accum
        self.grad_clip = float(cfg.grad_clip)
        seed_everything(cfg.seed)  # same seed on every rank here: identical init weights and data order
        self.strategy = strategy.make(cfg, state)
        self.task = build.task(cfg)
        self._step_fn = self.task  # the first step swaps in a checking wrapper (_first_step)
        self.callbacks = Callbacks(build.callbacks(cfg))
        self.data, self.sampler, self.train_loader, self.steps_per_epoch = build.train_data(
            cfg, state, self.global_batch, self.accum)
        self.memory_format = torch.channels_last if cfg.perf.channels_last else None
        self._build_model()
        self.loop = LoopState(seed=cfg.seed, accum=self.accum)
        # Higher is better only for what the task says (accuracy); losses, errors, perplexity: lower.
        self.results = Results(minimize=cfg.objective.split("/", 1)[-1] not in getattr(self.task, "maximize", ()))
        self.rng = RNGStreams(state)
        self.stop_reason: str | None = None  # set by request_stop (early stopping)
        self.evaluator = Evaluator(self.task, self.module, self.data, state, self.precision, self.strategy,
                                   max(self.sampler.per_rank_batch, 256), self._to_memory_format, cfg.get("limit_val_batches"))
        self.callbacks(Hook.SETUP, self)
        self._check_objective()
        self.checkpoints, self.guard = checkpoints_of(self)
        self.config_changes = resume(self)  # opted-in config changes applied, as text (or None)
        # The resumed run's last save: would a preemption's checkpoint be written within the launcher's grace?
        slow_save_warning(self.checkpoints.resumed_save_s, self.grace_s, "the last checkpoint of the resumed run")
        self.loop_start_step = self.loop.step  # where this invocation began (throughput in the summary)
        self.first_train_loss: float | None = None
        self.events_dir = rundir.events_dir(run_dir)  # tb/, or named after a sweep job's values
        # Steps after the checkpoint's were logged by an attempt that died: TensorBoard drops them. A run that
        # starts fresh where an attempt left events (killed before its first checkpoint) purges from step 1.
        earlier = self.loop.step or any(self.events_dir.glob("events.out.tfevents.*"))
        self.writer = make_writer(state, str(self.events_dir), purge_step=self.loop.step + 1 if earlier else None)
        self.metrics = TrainMetrics(state, getattr(self.task, "metric_names", ()), cfg.nonfinite_loss, self.accum,
                                    cfg.log_every_n_steps * self.accum)
        self._step_hooks = self.callbacks.hooks[Hook.ON_STEP_END]  # per step: an empty loop when none
        self._first_step_done = False
        self.watch = StallWatch(state.rank, state.world_size, cfg.distributed.timeout_s, default_store())  # a hung peer gets said
        self.flops = FlopRate(self.strategy.counts_flops, self.module, self._flop_sample, state.device,
                              self.precision.dtype, cfg.perf.peak_tflops, state.world_size)

    def _check_objective(self) -> None:
        """The objective must be a metric the task logs: otherwise no best checkpoint is ever kept and sweepers get None."""
        names = [f"val/{m}" for m in logged_names(self.task)] + self.callbacks.logged_names()
        if self.cfg.objective not in names:
            raise ConfigError(f"objective={self.cfg.objective!r}: {name_of(self.task)} logs no such metric. "
                              f"Fix: objective= one of {', '.join(names)}")

    def _build_model(self) -> None:
        cfg = self.cfg
        # Unwrapped module: evaluation and checkpoints use it; the step calls the wrapped one.
        self.module = self.strategy.prepare(build.model(cfg))
        self.model = self.strategy.wrap(self.module)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(instantiate(cfg.optimizer, _convert_="all"), self.params,
                                        self.strategy.fused_mode(cfg.perf.fused_optimizer))
        spe = self.steps_per_epoch
        self.scheduler = instantiate(cfg.scheduler, _convert_="all")(
            self.optimizer, total_steps=spe * cfg.num_epochs, steps_per_epoch=spe)
        self.precision = Precision(cfg.amp, cfg.amp_dtype, self.state.device)

    def position(self) -> str:
        return self.loop.position()

    # ------------------------------------------------------------------- loop
    def request_stop(self, reason: str) -> None:
        """Stop after the current epoch's evaluation and checkpoint (callbacks: decide alike on every rank)."""
        if self.stop_reason is None:
            self.stop_reason = reason
            log.info("%s", reason)

    def fit(self) -> dict[str, float]:
        cfg, loop = self.cfg, self.loop
        announce(self)
        self.callbacks(Hook.ON_FIT_START, self)
        last_train: dict[str, float] = {}
        if loop.epoch >= cfg.num_epochs:
            log.info("already finished: %d of %d epochs done, nothing to train", loop.epoch, cfg.num_epochs)
        t0 = time.perf_counter()
        stop = cfg.stop_after_epochs or cfg.num_epochs
        try:
            if loop.eval_pending:  # stopped before its epoch-end evaluation: that runs first
                self._end_epoch()
            while loop.epoch < min(cfg.num_epochs, stop) and self.stop_reason is None:
                last_train = self.run_epoch() or last_train
        except BaseException as e:
            self.callbacks(Hook.ON_EXCEPTION, self, e)
            raise
        finally:
            self.watch.close()
        best = self.results.best
        self.writer.close()
        # The checkpoint's record when this invocation trained nothing (resumed after the last step).
        out = {**(last_train or self.results.last_train), **self.results.last_val, "epoch": float(loop.epoch), "step": float(loop.step),
               "time_s": time.perf_counter() - t0}
        if best is not None:
            out[best_name(cfg.objective)] = best
        for line in run_summary(self, out):  # rank 0's last words: how it went, where things are
            log.info("%s", line)
        self.callbacks(Hook.ON_FIT_END, self, out)
        return out

    def evaluate_only(self) -> dict[str, float]:
        """mode=eval: the resumed checkpoint's exact evaluation (and the callbacks', e.g. val_ema/*)."""
        announce(self)
        val = self._evaluate_all()
        self.writer.scalars(val, self.loop.step)
        self.writer.close()
        return {**val, "epoch": float(self.loop.epoch), "step": float(self.loop.step)}

    def run_epoch(self) -> dict[str, float]:
        """One epoch: train, evaluate when due, checkpoint. Returns the last logged train metrics."""
        loop = self.loop
        last_train = self._train_epoch()
        loop.epoch += 1
        loop.step_in_epoch = loop.batches_in_epoch = 0
        loop.eval_pending = True
        if self.stopper.agreed:  # agreed in the epoch's last steps: its evaluation runs on resume
            self._preempt(self._save())
        self._end_epoch()
        return last_train

    def _end_epoch(self) -> None:
        """The epoch-end evaluation (when due) and checkpoint; a stop agreed during it saves and leaves."""
        cfg, loop = self.cfg, self.loop
        improved = False
        if loop.epoch % cfg.eval_every_n_epochs == 0 or loop.epoch == cfg.num_epochs:
            val = self._evaluate_all(interruptible=True)
            if val is None:  # every rank agreed to stop mid-evaluation: it reruns on resume
                self._preempt(self._save())
            improved = self.results.update(val, cfg.objective, loop.epoch, loop.step)
            best = {} if self.results.best is None else {best_name(cfg.objective): self.results.best}
            self.writer.scalars({**val, **best, "vitals/epoch": loop.epoch}, loop.step)  # the best so far: a curve
            self.evaluator.visualize(self.writer, loop.step)
            for line in wrap(f"epoch {loop.epoch}/{cfg.num_epochs} ", [f"{k}={v:.4g}" for k, v in val.items()]):
                log.info("%s", line)
        loop.eval_pending = False
        self._save(is_best=improved)

    def _save(self, is_best: bool = False) -> str:
        self.watch.pause()  # a save is not a step: the stall watch must not time it
        path = self.checkpoints.save(self.loop.step, is_best=is_best)
        if path:
            slow_save_warning(self.checkpoints.last_save_s, self.grace_s, f"checkpoint {Path(path).name}")
            self.callbacks(Hook.ON_SAVE, self, path)
        return path


    def _preempt(self, checkpoint: str | None) -> None:
        """Every rank agreed to stop here, right after a checkpoint: leave with status preempted."""
        raise Preempted(self.stopper.reason, self.loop.step, checkpoint)

    def _train_epoch(self) -> dict[str, float]:
        cfg, loop, stopper = self.cfg, self.loop, self.stopper
        # Plain values, read once: a config node's attribute access costs microseconds per step.
        log_every, skip_nonfinite = cfg.log_every_n_steps, cfg.nonfinite_loss == "skip"
        self.model.train()
        spe = self.steps_per_epoch
        # New global permutation each epoch; after a mid-epoch resume, skip what was consumed.
        self.train_loader.set_epoch(loop.epoch, skip=loop.batches_in_epoch * self.accum)
        self._seed_epoch()
        bar = self._progress_bar()
        reduced: dict[str, float] = {}
        batches = iter(self.train_loader)
        t_step = time.perf_counter()
        self.watch.mark(loop.step + 1, t_step)
        for _ in range(spe - loop.batches_in_epoch):
            data_time = self._forward_backward(batches) if self._first_step_done else self._first_step(batches)
            loop.batches_in_epoch += 1  # consumed, whether or not the step below is taken
            if skip_nonfinite and self._skip_nonfinite_step():
                continue
            self._optimizer_step()
            for hook in self._step_hooks:  # device-only work (EMA); none by default
                hook(self, loop.step)
            now = time.perf_counter()
            self.metrics.add_step(now - t_step, data_time)
            t_step = now
            self.watch.mark(loop.step + 1, now)
            bar.update(1)
            # The stop agreement rides in a log step's collective, or in a tiny one about once a second.
            if loop.step % log_every == 0:
                reduced = self._log(bar)
            else:
                stopper.after_step()
            if stopper.agreed and loop.batches_in_epoch < spe:  # at the epoch's end: run_epoch saves
                if self.metrics.steps:  # the interval so far is logged before the checkpoint: none lost
                    reduced = self._log(bar)
                bar.close()
                self._preempt(self._save())
            if self.checkpoints.due(loop.step, loop.batches_in_epoch, spe):
                if self.metrics.steps:  # a checkpoint closes the log interval: no metrics lost on resume
                    reduced = self._log(bar)
                self._save()
                t_step = time.perf_counter()
                self.watch.mark(loop.step + 1, t_step)
        self.watch.pause()
        if self.metrics.steps:  # the epoch's tail since the last log step
            reduced = self._log(bar)
        bar.close()
        return reduced

    def _seed_epoch(self) -> None:
        """Random streams for dropout/augmentation at the start of (a part of) an epoch."""
        if self.loop.batches_in_epoch:
            self.rng.restore()  # mid-epoch resume: continue the saved streams exactly, if there are any
            return
        # Per-rank stream: differs between ranks and depends only on (seed, epoch, rank),
        # so a resumed run replays it.
        seed_everything(self.cfg.seed + 1_000_003 * (self.loop.epoch + 1) + self.state.rank)

    def _forward_backward(self, batches: Iterator[Any]) -> float:
        """The micro-batches of one optimizer step; returns the time spent waiting for data."""
        data_time, watch = 0.0, self.watch  # watch.phase: where a stalled step is, should one stall
        for micro in range(self.accum):
            t = time.perf_counter()
            watch.phase = "data loading"
            batch = self._to_memory_format(next(batches))
            data_time += time.perf_counter() - t
            # Gradients all-reduce only on the last micro-batch of a step.
            with self.strategy.no_sync(self.model) if micro < self.accum - 1 else contextlib.nullcontext():
                watch.phase = "forward"
                with self.precision.autocast():
                    out = self._step_fn(self.model, batch)
                watch.phase = "backward"
                self.precision.backward(out.loss / self.accum if self.accum > 1 else out.loss)
            self.metrics.add_micro(out)
        return data_time

    def _first_step(self, batches: Iterator[Any]) -> float:
        """The first forward/backward: a model that cannot take the data's shapes fails here, said plainly."""
        self._step_fn = self._checked_step
        try:
            data_time = self._forward_backward(batches)
        except RuntimeError as e:
            if not _SHAPE_ERROR.search(str(e)):
                raise
            ds, name = self.cfg.dataset, self.cfg.model.get("_target_", "the model")
            sizes = ", ".join(f"dataset.{k}={ds[k]}" for k in ("in_channels", "image_size", "num_classes") if k in ds)
            raise ConfigError(
                f"{name} cannot train on {ds.get('_target_', 'the dataset')}'s samples ({sizes}): "
                f"{str(e).splitlines()[0]}. Fix: choose dataset sizes this model accepts (a larger "
                "dataset.image_size for convolution stacks), or a model made for them (model=mlp takes any)") from e
        self._step_fn = self.task
        self._first_step_done = True
        self.strategy.after_first_backward(self.module)
        return data_time

    def _checked_step(self, model: Any, batch: Any) -> Any:
        """The task's step with its batch and output checked (first step only: host metadata, no sync)."""
        check_batch(self.task, batch)
        return check_output(self.task, self.task(model, batch))

    def _optimizer_step(self) -> None:
        self.watch.phase = "optimizer"
        norm = self.precision.step(self.optimizer, self.params, self.grad_clip)
        if norm is not None:
            self.metrics.add_grad_norm(self.strategy.grad_norm(norm))
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.loop.step += 1
        self.loop.step_in_epoch += 1

    def _skip_nonfinite_step(self) -> bool:
        """nonfinite_loss=skip: drop this step on every rank if any rank's loss (any micro-batch) is NaN/Inf."""
        bad = (~torch.isfinite(self.metrics.last_step_losses())).any()
        if not collectives.any_rank(bad, self.state):  # sync + collective: skip mode's cost
            return False
        self.optimizer.zero_grad(set_to_none=True)
        self.metrics.skipped += 1
        log.warning("non-finite loss at step %d: step skipped (nonfinite_loss=skip)", self.loop.step + 1)
        return True

    def _log(self, bar: Progress) -> dict[str, float]:
        step = self.loop.step
        self.watch.phase = "log collective"
        # The one collective (and host sync) of this interval; it also carries this rank's stop request.
        values = self.metrics.reduce(f"{self.position()}; task {name_of(self.task)}", step, self.stopper.requested)
        self.stopper.heard_at_log_step(self.metrics.stop_agreed)
        values.update(derived(self.task, values, "train/"))
        if self.first_train_loss is None:  # the barely trained model's loss: the summary's yardstick
            self.first_train_loss = values.get("train/loss")
        self.callbacks(Hook.ON_LOG, self, values, step)
        values["vitals/lr"] = self.optimizer.param_groups[0]["lr"]
        values.update(self.flops.rates(values["vitals/samples_per_s"]))
        scale = self.precision.loss_scale()
        if scale is not None:
            values["vitals/loss_scale"] = scale
            values["train/fp16_skipped_steps"] = self.precision.pop_overflow_steps()  # not errors: the scaler's job
        self.writer.scalars(values, step)
        bar.show(self.loop.epoch, step, values)
        self.results.last_train = values
        return values

    def _to_memory_format(self, batch: Any) -> Any:
        """Image batches (4-D float tensors) in the model's memory format (NHWC with perf.channels_last)."""
        fmt = self.memory_format
        if fmt is None:
            return batch
        return map_tensors(batch, lambda t: t.contiguous(memory_format=fmt) if t.dim() == 4 and t.is_floating_point()
                           else t)

    def _flop_sample(self) -> torch.Tensor | None:
        """One sample's input, for counting the model's FLOPs (the first tensor of a training sample)."""
        x = first_tensor(self.data.train[0])
        return None if x is None else self._to_memory_format(x[None].to(self.state.device))

    def evaluate(self) -> dict[str, float]:
        return self.evaluator.run()

    def _evaluate_all(self, interruptible: bool = False) -> dict[str, float] | None:
        """The evaluation plus what callbacks add to it (e.g. val_ema/*). ``interruptible``: None when
        every rank agreed to stop during it (a preemption signal)."""
        val = self.evaluator.run(self.stopper if interruptible else None)
        if val is None:
            return None
        for extra in self.callbacks(Hook.ON_EVAL_END, self, val):
            val.update(extra or {})
        return val

    def _progress_bar(self) -> Progress:
        return Progress.for_rank(str(self.cfg.progress), self.state.is_main, self.steps_per_epoch, self.loop.epoch,
                                 self.cfg.num_epochs)
