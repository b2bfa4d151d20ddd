"""What a training job is made of, as callbacks, reporting and resuming see it (Composer's ``State`` is the
model). The Trainer builds one :class:`State` and runs the loop over it; nothing outside ``trainer.py``
reads the Trainer (``tests/test_architecture.py`` keeps it so).

Callbacks receive it as their first argument (``ddplab.callbacks.Hook`` says when)::

    def on_log(self, state, values, step):
        if values["train/loss"] > 10:
            state.request_stop("loss exploded")   # every rank decides alike: values are reduced

What is in it (see each field): the config and where the job runs (``cfg``, ``dist``, ``run_dir``); the
parts (``task``, ``strategy``, ``module``/``model``, ``optimizer``, ``scheduler``, ``precision``, the data,
``evaluator``, ``callbacks``); the loop's records (``loop``: position, ``results``: evaluations, ``rng``);
and what the job writes (``writer``, ``checkpoints``, ``events_dir``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: importing these here would make state.py import half the package
    import torch
    from omegaconf import DictConfig

    from ddplab.checkpoint import CheckpointManager
    from ddplab.checkpoint.rng import RNGStreams
    from ddplab.data.loaders import TrainLoader
    from ddplab.data.sampling import ShardedGlobalSampler
    from ddplab.data.streams import StreamLoader
    from ddplab.evaluation import Evaluator
    from ddplab.length import RunLength
    from ddplab.precision import Precision
    from ddplab.runtime.group import DistState
    from ddplab.strategy.base import Strategy
    from ddplab.trainstate import LoopState, Results

log = logging.getLogger("ddplab")


@dataclass(eq=False)
class State:
    cfg: DictConfig                      # the composed config (rank 0's, on every rank)
    dist: DistState                      # rank, world size, device, backend of this process
    run_dir: Path                        # the job's run dir (rank 0 writes it)
    task: Any                            # batch -> loss + named (sum, count) metrics
    strategy: Strategy                   # none | dp | ddp | fsdp: wraps, syncs, checkpoints the model
    module: torch.nn.Module              # the model itself: evaluation, checkpoints, EMA
    model: torch.nn.Module               # what the step calls: ``module`` wrapped by the strategy
    params: list[torch.nn.Parameter]     # the trainable parameters
    optimizer: torch.optim.Optimizer
    scheduler: Any                       # learning-rate schedule, stepped once per optimizer step
    precision: Precision                 # autocast dtype and the fp16 GradScaler, if any
    data: Any                            # the dataset's splits (``.train``, ``.val``)
    sampler: ShardedGlobalSampler        # this rank's share of each global micro-batch
    train_loader: TrainLoader | StreamLoader
    steps_per_epoch: int                 # optimizer steps per epoch
    length: RunLength                    # how long the run trains: epochs, max_steps, or both
    global_batch: int                    # samples per micro-step, over all ranks
    accum: int                           # micro-batches per optimizer step (grad_accum_steps)
    loop: LoopState                      # epochs, steps and batch groups done: the position
    results: Results                     # evaluations: the last, the first, the best of the objective
    rng: RNGStreams                      # every rank's random streams (checkpointed)
    evaluator: Evaluator                 # the exact evaluation
    callbacks: Any                       # ddplab.callbacks.Callbacks (a type import would be a cycle)
    search_earlier_runs: bool = False    # resume=auto may continue an earlier run of the same command
    writer: Any = None                   # rank 0's TensorBoard writer (a do-nothing one elsewhere); None in setup
    checkpoints: CheckpointManager | None = None  # set after the callbacks' setup (they may add entries)
    events_dir: Path | None = None       # where the TensorBoard events go
    config_changes: str | None = None    # opted-in config changes applied at resume, as text
    loop_start_step: int = 0             # the step this invocation began at (throughput in the summary)
    first_train_loss: float | None = None  # the first logged train/loss: the summary's yardstick
    stop_reason: str | None = None       # set by request_stop: the job stops after the current evaluation

    @property
    def samples_per_step(self) -> int:
        """Samples of one optimizer step over all ranks."""
        return self.global_batch * self.accum

    def request_stop(self, reason: str) -> None:
        """Stop after the current evaluation (an epoch's, or a step's with eval_every_n_steps) and its checkpoint.
        Callbacks: decide alike on every rank (from reduced values), or ranks part ways."""
        if self.stop_reason is None:
            self.stop_reason = reason
            log.info("%s", reason)

    def position(self) -> str:
        return self.loop.position()
