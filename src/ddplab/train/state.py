"""What a training job is made of, as callbacks, reporting and resuming see it (Composer's ``State`` is the
model), and the loop's own small records in it (:class:`LoopState`: the position; :class:`Results`: the
evaluations; both checkpointed). ``ddplab.train.assemble.build_state`` makes a State complete and resumed,
before any hook sees it; the Trainer (``ddplab.train.loop``) runs over it; nothing outside ``ddplab.train``
reads the Trainer (``tests/unit/test_architecture.py`` keeps it so).

Callbacks receive it as their first argument (``ddplab.train.hooks.Hook`` says when)::

    def on_log(self, state, values, step):
        if values["train/loss"] > 10:
            state.request_stop("loss exploded")   # every rank decides alike: values are reduced

What is in it (see each field): the config and where the job runs (``cfg``, ``dist``, ``run_dir``); the
parts (``task``, ``strategy``, ``module``/``model``, ``optimizer``, ``scheduler``, ``precision``, the data,
``evaluator``, ``callbacks``); the loop's records (``loop``: position, ``results``: evaluations, ``rng``);
what the job writes (``writer``, ``checkpoints``, ``events_dir``) and the preemption flag (``stop``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # types only: importing these here would make state.py import half the package
    import torch
    from omegaconf import DictConfig

    from ddplab.checkpoint import CheckpointManager
    from ddplab.checkpoint.rng import RNGStreams
    from ddplab.data import Splits
    from ddplab.data.loaders import TrainLoader
    from ddplab.data.sampling import ShardedGlobalSampler
    from ddplab.data.streams import StreamLoader
    from ddplab.precision import Precision
    from ddplab.runtime.group import Dist
    from ddplab.runtime.signals import StopSignal
    from ddplab.strategy.base import Strategy
    from ddplab.task import Task
    from ddplab.train.evaluation import Evaluator
    from ddplab.train.hooks import Callbacks
    from ddplab.train.length import RunLength
    from ddplab.writers import Writer

log = logging.getLogger("ddplab")


@dataclass(eq=False)
class State:
    cfg: DictConfig  # the composed config (rank 0's, on every rank)
    dist: Dist  # rank, world size, device, backend of this process
    run_dir: Path  # the job's run dir (rank 0 writes it)
    task: Task  # batch -> loss + named (sum, count) metrics (or any class alike)
    strategy: Strategy  # none | dp | ddp | fsdp: wraps, syncs, checkpoints the model
    module: torch.nn.Module  # the model itself: evaluation, checkpoints, EMA
    model: torch.nn.Module  # what the step calls: ``module`` wrapped by the strategy
    params: list[torch.nn.Parameter]  # the trainable parameters
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # learning-rate schedule, stepped once per optimizer step
    precision: Precision  # autocast dtype and the fp16 GradScaler, if any
    memory_format: Callable[[Any], Any]  # a batch in the model's memory format (channels_last images)
    data: Splits  # the dataset's splits (``.train``, ``.val``)
    sampler: ShardedGlobalSampler  # this rank's share of each global micro-batch
    train_loader: TrainLoader | StreamLoader
    steps_per_epoch: int  # optimizer steps per epoch
    length: RunLength  # how long the run trains: epochs, max_steps, or both
    global_batch: int  # samples per micro-step, over all ranks
    accum: int  # micro-batches per optimizer step (grad_accum_steps)
    loop: LoopState  # epochs, steps and batch groups done: the position
    results: Results  # evaluations: the last, the first, the best of the objective
    rng: RNGStreams  # every rank's random streams (checkpointed)
    evaluator: Evaluator  # the exact evaluation
    callbacks: Callbacks  # the job's callbacks, called per hook
    stop: StopSignal  # the preemption flag a signal (or a dead launcher) sets
    writer: Writer  # rank 0's TensorBoard writer (a do-nothing one elsewhere)
    events_dir: Path  # where the TensorBoard events go
    checkpoints: CheckpointManager  # saves and loads every stateful part (callbacks' entries included)
    search_earlier_runs: bool = False  # resume=auto may continue an earlier run of the same command
    stop_reason: str | None = None  # set by request_stop: the job stops after the current evaluation

    @property
    def samples_per_step(self) -> int:
        """Samples of one optimizer step over all ranks."""
        return self.global_batch * self.accum

    def request_stop(self, reason: str) -> None:
        """Stop after the current evaluation (an epoch's, or a step's with eval_every_n_steps) and its
        checkpoint. Callbacks: decide alike on every rank (from reduced values), or ranks part ways."""
        if self.stop_reason is None:
            self.stop_reason = reason
            log.info("%s", reason)

    def position(self) -> str:
        return self.loop.position()


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
    # where this invocation began: the resumed step (throughput in the summary; not saved)
    start_step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "step_in_epoch": self.step_in_epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "eval_pending": self.eval_pending,
            # The sampler needs no state of its own: (seed, epoch, position) fix its order.
            "sampler": {
                "seed": self.seed,
                "epoch": self.epoch,
                "skip_micro_batches": self.batches_in_epoch * self.accum,
            },
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.step, self.step_in_epoch = sd["epoch"], sd["step"], sd.get("step_in_epoch", 0)
        # older checkpoints: no skips known
        self.batches_in_epoch = sd.get("batches_in_epoch", self.step_in_epoch)
        self.eval_pending = sd.get("eval_pending", False)
        self.start_step = self.step

    def stepped(self) -> None:
        """One optimizer step done (its batch group was counted when it was consumed)."""
        self.step += 1
        self.step_in_epoch += 1

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
    # This invocation's first logged train/loss, the barely trained model's: the summary's yardstick (not
    # saved).
    first_train_loss: float | None = None

    def final(self, objective: str, loop: LoopState, seconds: float) -> dict[str, float]:
        """What the run returns: the last train and val metrics (the checkpoint's record when this invocation
        trained nothing), where it ended, how long it took, and the best objective."""
        out = {
            **self.last_train,
            **self.last_val,
            "epoch": float(loop.epoch),
            "step": float(loop.step),
            "time_s": seconds,
        }
        if self.best is not None:
            out[best_name(objective)] = self.best
        return out

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
        return {
            "best": self.best,
            "best_epoch": self.best_epoch,
            "best_step": self.best_step,
            "last_val": self.last_val,
            "last_train": self.last_train,
            "first_val": self.first_val,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.best, self.last_val = sd["best"], sd.get("last_val", {})
        self.best_epoch, self.best_step = sd.get("best_epoch", 0), sd.get("best_step", 0)
        self.first_val = sd.get("first_val", {})
        # Kept in the checkpoint so that a run resumed after its last step (or its last evaluation)
        # still reports what its training measured (result.json must not lose train/*).
        self.last_train = sd.get("last_train", {})
