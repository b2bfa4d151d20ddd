"""What a run reports besides scalars: its HParams entry and the rank-0 progress display."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddplab import rundir

log = logging.getLogger("ddplab")


def hparams_of(cfg: DictConfig, run_dir: Path, world_size: int) -> dict[str, Any]:
    """What a sweep varies (this job's overrides, as typed values) plus the key settings."""
    def short(target: Any) -> Any:
        return str(target).rsplit(".", 1)[-1] if target else target

    hp: dict[str, Any] = {
        "task": short(cfg.task.get("_target_")) if cfg.get("task") else None,
        "model": short(cfg.model.get("_target_")), "dataset": short(cfg.dataset.get("_target_")),
        "optimizer": short(cfg.optimizer.get("_target_")), "optimizer.lr": cfg.optimizer.get("lr"),
        "optimizer.weight_decay": cfg.optimizer.get("weight_decay"), "batch_size": cfg.batch_size,
        "grad_accum_steps": cfg.grad_accum_steps, "num_epochs": cfg.num_epochs, "amp": cfg.amp,
        "seed": cfg.seed, "world_size": world_size,
    }
    for o in rundir.read_overrides(run_dir) or []:
        key, _, value = o.lstrip("+~").partition("=")
        if key.startswith("hydra") or key in ("resume", "stop_after_epochs", "run_dir"):
            continue
        node = OmegaConf.select(cfg, key, default=None)
        hp[key] = value if isinstance(node, DictConfig) or node is None else node  # group=option: the name
    return {k: v for k, v in hp.items() if v is not None}


class Progress:
    """tqdm bar on a terminal, periodic log lines otherwise, nothing on other ranks."""

    def __init__(self, mode: str, total: int, epoch: int, num_epochs: int):
        self.mode, self._bar = mode, None
        self.num_epochs = num_epochs
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=f"epoch {epoch + 1}/{num_epochs}", leave=False, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def show(self, epoch: int, step: int, values: dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{values.get('train/loss', math.nan):.4f}",
                                  acc=f"{values.get('train/acc', math.nan):.3f}", refresh=False)
        elif self.mode == "log":
            log.info("epoch %d step %d  loss=%.4f acc=%.3f lr=%.3g  %.0f samples/s  step %.1f ms (max %.1f)",
                     epoch + 1, step, values.get("train/loss", math.nan), values.get("train/acc", math.nan),
                     values["train/lr"], values["perf/samples_per_s"], values["perf/step_time_ms"],
                     values["perf/step_time_ms_max"])

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
