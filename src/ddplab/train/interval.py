"""The log interval: what the loop does between two log steps, owned by one object.

After each optimizer step the loop calls :meth:`LogInterval.after_step`, which times the step, marks the
stall watch, advances the progress bar and then either holds the log step's one collective (the metrics
reduced with every rank's stop flag in the same row, the callbacks' ``on_log``, TensorBoard, the progress
line) or counts down to the stop agreement's next check. It returns whether every rank agreed to stop at
this step. :meth:`close` logs the steps since the last log step (before a checkpoint, an evaluation or an
epoch's end: none is lost on resume); :meth:`restart` starts timing again after such a pause.

What the step itself shows no line of, its :class:`StepProbe` keeps: the time it waited for data and where
it is (for the stall watch), told at the three points the step passes anyway.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

from ddplab.data.batches import first_tensor
from ddplab.perf import FlopRate
from ddplab.runtime.stopping import StopAgreement
from ddplab.runtime.watch import StallWatch, default_store
from ddplab.task import name_of
from ddplab.train.evaluation import derived
from ddplab.train.hooks import Hook
from ddplab.train.metrics import TrainMetrics
from ddplab.train.reporting import Progress
from ddplab.train.state import State


class StepProbe:
    """The step's points, as the rest of the loop sees them (attribute writes: no sync): each batch's fetch
    (timed: the interval's data time; the stall watch told the step waits for data, then runs its forward),
    the task's call (the watch told the backward comes next), the optimizer's step (its pre-hook: the watch
    told so), and the gradients made ready for it (nothing but in the first step: its checks,
    :class:`ddplab.train.first_step.FirstStep`, which also puts the checked task in ``task`` for that
    step)."""

    def __init__(self, task: Any, watch: StallWatch, optimizer: Any):
        self.task, self.watch = task, watch
        self.waited = 0.0  # seconds this step waited for its batches
        self.gradients_ready: Callable[[], None] = _nothing  # after the last backward, before any update
        optimizer.register_step_pre_hook(self._optimizing)

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        watch, clock = self.watch, time.perf_counter
        while True:
            watch.phase = "data loading"
            t = clock()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.waited += clock() - t
            watch.phase = "forward"
            yield batch

    def forward(self, model: Any, batch: Any) -> Any:
        out = self.task(model, batch)
        self.watch.phase = "backward"  # DDP's gradients all-reduce in it: a phase that waits for peers
        return out

    @contextlib.contextmanager
    def checked(self, task: Callable[[Any, Any], Any], gradients_ready: Callable[[], None]) -> Iterator[None]:
        """For one step (the first): the task called through its checks, the gradients checked when ready."""
        plain = self.task
        self.task, self.gradients_ready = task, gradients_ready
        try:
            yield
        finally:
            self.task, self.gradients_ready = plain, _nothing

    def _optimizing(self, *_: Any) -> None:
        self.watch.phase = "optimizer"


def _nothing() -> None:
    """StepProbe.gradients_ready but in the first step."""


class LogInterval:
    def __init__(self, s: State, stopper: StopAgreement):
        cfg, dist = s.cfg, s.dist
        self.state, self.stopper = s, stopper
        self.every = int(cfg.log_every_n_steps)  # a plain int: read every step
        self.metrics = TrainMetrics(
            dist,
            getattr(s.task, "metric_names", ()),
            cfg.nonfinite_loss,
            s.accum,
            cfg.log_every_n_steps * s.accum,
        )
        # a hung peer gets said
        self.watch = StallWatch(dist.rank, dist.world_size, cfg.distributed.timeout_s, default_store())
        self.flops = FlopRate(
            s.strategy.counts_flops,
            s.module,
            dist.device,
            s.precision.dtype,
            cfg.perf.peak_tflops,
            dist.world_size,
        )  # counted on a batch in hand (keep)
        self.tokens_per_sample = 0  # a task that counts tokens: the first batch's sequence length
        self.bar = Progress("none")  # each epoch draws its own (new_bar)
        self.probe = StepProbe(s.task, self.watch, s.optimizer)  # the step's data time and stall phases
        self._t = time.perf_counter()

    def keep(self, batch: Any) -> None:
        """The first batch (the checked step's): a sample for the FLOP count, the tokens per sample."""
        self.flops.keep(batch)
        x = first_tensor(batch) if getattr(self.state.task, "counts_tokens", False) else None
        if x is not None and x.dim() >= 2:
            self.tokens_per_sample = int(x.shape[1])

    def new_bar(self) -> None:
        s = self.state
        self.bar = Progress.for_rank(
            str(s.cfg.progress), s.dist.is_main, s.steps_per_epoch, s.loop.epoch, s.length
        )

    def restart(self) -> None:
        """Timing starts (again): at an epoch's first step, after a checkpoint or an evaluation."""
        self._t = time.perf_counter()
        self.watch.mark(self.state.loop.step + 1, self._t)

    def after_step(self) -> bool:
        """After optimizer step ``state.loop.step``: True when every rank agreed to stop here."""
        now = time.perf_counter()
        self.metrics.add_step(now - self._t, self.probe.waited)
        self.probe.waited = 0.0
        self._t = now
        step = self.state.loop.step
        self.watch.mark(step + 1, now)
        self.bar.update(1)
        # The stop agreement rides in a log step's collective, or in a tiny one about once a second.
        if step % self.every == 0:
            self.log()
        else:
            self.stopper.after_step()
        return self.stopper.agreed

    def close(self) -> None:
        """The steps since the last log step are logged (none lost on resume); the stall watch stops timing
        (a save or an evaluation is not a step)."""
        self.watch.pause()
        if self.metrics.steps:
            self.log()

    def log(self) -> dict[str, float]:
        s = self.state
        step = s.loop.step
        self.watch.phase = "log collective"
        # The one collective (and host sync) of this interval; it also carries this rank's stop request.
        values, anyone_stops = self.metrics.reduce(
            f"{s.position()}; task {name_of(s.task)}", step, self.stopper.requested
        )
        self.stopper.heard_at_log_step(anyone_stops)
        values.update(derived(s.task, values, "train/"))
        if s.results.first_train_loss is None:  # the barely trained model's loss: the summary's yardstick
            s.results.first_train_loss = values.get("train/loss")
        s.callbacks(Hook.ON_LOG, s, values, step)
        values["vitals/lr"] = s.optimizer.param_groups[0]["lr"]
        values.update(self.flops.rates(values["vitals/samples_per_s"]))
        if self.tokens_per_sample:
            values["vitals/tokens_per_s"] = values["vitals/samples_per_s"] * self.tokens_per_sample
        scale = s.precision.loss_scale()
        if scale is not None:
            values["vitals/loss_scale"] = scale
            # not errors: the scaler's job
            values["train/fp16_skipped_steps"] = s.precision.pop_overflow_steps()
        s.writer.scalars(values, step)
        self.bar.show(s.loop.epoch, step, values)
        s.results.last_train = values
        return values
