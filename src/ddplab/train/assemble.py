"""How a job's :class:`State` comes to be: ``build_state(cfg, dist, run_dir) -> State``, complete and resumed.

    seed → strategy, task, callbacks, data, model (prepared, wrapped), optimizer, length, schedule,
    precision, evaluator, writer, checkpoint manager → State → callbacks' SETUP(state)
    → checkpoint entries registered → resume (ON_LOAD) → TensorBoard told where the resumed run starts

Every field of the State is set here, before the first hook sees it; nothing is filled in later. The loop
(``ddplab.train.loop``) only runs over it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from ddplab import build, compat, rundir, strategy
from ddplab.checkpoint.rng import RNGStreams, seed_everything
from ddplab.data.batches import in_memory_format
from ddplab.data.datasets import Splits
from ddplab.optim import make_optimizer
from ddplab.precision import Precision
from ddplab.runtime import env
from ddplab.runtime.group import Dist
from ddplab.runtime.signals import StopSignal
from ddplab.runtime.stopping import slow_save_warning
from ddplab.task import Task, check_objective
from ddplab.tracking_setup import writer_for
from ddplab.train.batch_size import global_batch_size
from ddplab.train.evaluation import Evaluator
from ddplab.train.hooks import Callbacks, Hook
from ddplab.train.length import RunLength
from ddplab.train.resuming import ResumeGuard, checkpoint_manager, register_entries, resume
from ddplab.train.state import LoopState, Results, State


def build_state(
    cfg: DictConfig,
    dist: Dist,
    run_dir: Path,
    *,
    evaluating: bool = False,
    search_earlier_runs: bool = False,
    stop: StopSignal | None = None,
    provenance: str | None = None,
) -> State:
    """The job's parts from ``cfg``, in an order that fixes the random draws (same seed on every rank here:
    identical initial weights and data order), resumed as ``cfg.resume`` says. ``evaluating``: mode=eval (the
    batch need not divide the data; training-only callbacks left out). ``search_earlier_runs``: resume=auto
    may continue the newest earlier run of the same command (only for run dirs Hydra made up). ``stop``: the
    Session's preemption flag (a fresh, never-set one when None). ``provenance``: TensorBoard's Text tab."""
    global_batch = global_batch_size(cfg, dist.world_size, exact=not evaluating)
    accum = cfg.grad_accum_steps
    strat = strategy.make(cfg, dist)  # draws nothing
    # torch's first manual_seed or optimizer call would import its compiler stack: 2 s of CPU a rank
    compat.defer_dynamo(strat.rank_imports)
    seed_everything(cfg.seed)
    task = build.task(cfg)
    callbacks = Callbacks(build.callbacks(cfg, evaluating=evaluating))
    data, sampler, loader, spe = build.train_data(cfg, dist, global_batch, accum)
    m = _model(cfg, dist, strat, task, data, sampler.per_rank_batch, spe)
    events_dir = rundir.events_dir(run_dir)  # tb/, or named after a sweep job's values
    stop = stop or StopSignal()
    guard = ResumeGuard(cfg, dist.world_size)  # a checkpoint of another config is refused
    s = State(
        cfg=cfg,
        dist=dist,
        run_dir=run_dir,
        task=task,
        strategy=strat,
        **m._asdict(),
        data=data,
        sampler=sampler,
        train_loader=loader,
        steps_per_epoch=spe,
        global_batch=global_batch,
        accum=accum,
        loop=LoopState(seed=cfg.seed, accum=accum),
        results=Results(minimize=_minimized(cfg.objective, task)),
        rng=RNGStreams(dist),
        callbacks=callbacks,
        stop=stop,
        events_dir=events_dir,
        writer=writer_for(dist, str(events_dir), cfg, run_dir, evaluating),
        # on_save hears of each checkpoint once it is on disk (with async_save: after the write).
        checkpoints=checkpoint_manager(
            cfg, dist, run_dir, guard, stop.request, saved=lambda path: callbacks(Hook.ON_SAVE, s, path)
        ),
        search_earlier_runs=search_earlier_runs,
    )
    callbacks(Hook.SETUP, s)
    # The objective must be a metric the task logs: otherwise no best checkpoint is kept and sweepers get
    # None.
    check_objective(cfg.objective, task, callbacks.logged_names())
    _resume(s, guard, provenance)
    return s


class _Model(NamedTuple):
    """The State's fields that stand or fall with the model: built in this order, after the data (their
    draws)."""

    module: torch.nn.Module  # unwrapped: evaluation and checkpoints use it
    model: torch.nn.Module  # wrapped by the strategy: the step calls it
    params: list[torch.nn.Parameter]
    precision: Precision
    optimizer: torch.optim.Optimizer
    length: RunLength
    scheduler: torch.optim.lr_scheduler.LRScheduler
    memory_format: Callable[[Any], Any]
    evaluator: Evaluator


def _model(
    cfg: DictConfig,
    dist: Dist,
    strat: strategy.Strategy,
    task: Task,
    data: Splits,
    per_rank_batch: int,
    spe: int,
) -> _Model:
    module = strat.prepare(build.model(cfg, data.num_classes))
    model = strat.wrap(module)
    params = [p for p in module.parameters() if p.requires_grad]
    precision = Precision(cfg.amp, cfg.amp_dtype, dist.device)
    optimizer = make_optimizer(
        instantiate(cfg.optimizer, _convert_="all"),
        params,
        strat.fused_mode(cfg.perf.fused_optimizer),
        scaled=precision.scaler is not None,
    )
    length = RunLength(spe, cfg.num_epochs, cfg.max_steps)
    scheduler = instantiate(cfg.scheduler, _convert_="all")(
        optimizer, total_steps=length.total_steps, steps_per_epoch=spe
    )
    memory_format = functools.partial(
        in_memory_format, fmt=torch.channels_last if cfg.perf.channels_last else None
    )
    evaluator = Evaluator(
        task,
        module,
        data,
        dist,
        precision,
        strat,
        max(per_rank_batch, 256),
        memory_format,
        cfg.limit_val_batches,
    )
    return _Model(module, model, params, precision, optimizer, length, scheduler, memory_format, evaluator)


def _minimized(objective: str, task: Task) -> bool:
    """Higher is better only for what the task says (accuracy); losses, errors, perplexity: lower."""
    return objective.split("/", 1)[-1] not in getattr(task, "maximize", ())


def _resume(s: State, guard: ResumeGuard, provenance: str | None) -> None:
    """Load what ``resume`` names (callbacks' entries included: setup may have made them); tell TensorBoard
    where this invocation starts."""
    register_entries(s)
    changes = resume(s, guard)  # opted-in config changes applied, as text (or None)
    # The resumed run's last save: would a preemption's checkpoint be written within the launcher's grace?
    slow_save_warning(
        s.checkpoints.resumed_save_s, env.launcher_grace_s(), "the last checkpoint of the resumed run"
    )
    # Steps after the checkpoint's were logged by an attempt that died: TensorBoard drops them. A run that
    # starts fresh where an attempt left events (killed before its first checkpoint) purges from step 1.
    if s.loop.step or any(s.events_dir.glob("events.out.tfevents.*")):
        s.writer.purge_after(s.loop.step)
    if changes:
        s.writer.text("config_changes", changes)
    if provenance:
        s.writer.text("provenance", provenance)
