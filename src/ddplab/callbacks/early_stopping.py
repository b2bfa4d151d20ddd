"""Early stopping on any logged metric; every rank decides alike from the same reduced value."""

from __future__ import annotations

import logging
import math
from typing import Any

from ddplab.config.errors import ConfigError
from ddplab.train.callback import Callback
from ddplab.train.state import State

log = logging.getLogger("ddplab")


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` checks, or when it
    crosses ``divergence_threshold`` (or stops being finite).

    ``monitor`` is any logged tag: ``val/*`` and ``val_ema/*`` are checked after each evaluation, ``train/*``
    at each log step; training stops after the current evaluation (an epoch's, or with eval_every_n_steps a
    step's) and its checkpoint. ``mode``: ``min``, ``max`` or ``auto`` (the task's ``maximize`` decides). The
    values are the reduced ones, equal on every rank, so all ranks stop at the same step."""

    training_only = True  # it decides when training stops: nothing to decide in mode=eval

    def __init__(
        self,
        monitor: str = "val/loss",
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "auto",
        divergence_threshold: float | None = None,
        check_finite: bool = True,
    ):
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"callbacks.early_stopping.mode={mode!r}: use auto, min or max")
        if patience < 1:
            raise ValueError(f"callbacks.early_stopping.patience={patience}: must be >= 1")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, abs(min_delta), mode
        self.divergence_threshold, self.check_finite = divergence_threshold, check_finite
        self.best: float | None = None
        self.best_epoch = 0
        self.wait = 0

    def setup(self, state: State) -> None:
        if self.mode == "auto":
            name = self.monitor.split("/", 1)[-1]
            self.mode = "max" if name in getattr(state.task, "maximize", ()) else "min"

    def on_log(self, state: State, values: dict[str, float], step: int) -> None:
        if self.monitor.startswith("train/") and self.monitor in values:
            self._check(state, values[self.monitor])

    def on_eval_end(self, state: State, metrics: dict[str, float]) -> None:
        if not self.monitor.startswith("train/"):
            if self.monitor not in metrics:
                # Found at the first evaluation, alike on every rank: still the config's fault (one line, exit
                # 2).
                raise ConfigError(
                    f"callbacks.early_stopping.monitor={self.monitor!r} is not logged (evaluation "
                    f"logged {sorted(metrics)}). Fix: monitor one of those"
                )
            self._check(state, metrics[self.monitor])

    def _check(self, state: State, value: float) -> None:
        epoch = state.loop.epoch  # where the check is, said by the run's evaluation cadence
        at = f"step {state.loop.step}" if state.cfg.eval_every_n_steps else f"epoch {epoch}"
        sign = 1.0 if self.mode == "min" else -1.0
        if self.check_finite and not math.isfinite(value):
            return state.request_stop(f"stopped early at {at}: {self.monitor}={value} is not finite")
        if self.divergence_threshold is not None and sign * (value - self.divergence_threshold) > 0:
            return state.request_stop(
                f"stopped early at {at}: {self.monitor}={value:.6g} crossed "
                f"divergence_threshold={self.divergence_threshold}"
            )
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.best_epoch, self.wait = value, epoch, 0
            return None
        self.wait += 1
        if self.wait >= self.patience:
            state.request_stop(
                f"stopped early at {at}: {self.monitor} did not improve by more than "
                f"{self.min_delta} for {self.patience} checks (best {self.best:.6g} at epoch "
                f"{self.best_epoch})"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait, "mode": self.mode}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.best, self.best_epoch, self.wait, self.mode = (
            sd["best"],
            sd["best_epoch"],
            sd["wait"],
            sd["mode"],
        )
