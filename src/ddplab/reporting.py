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


def announce(t: Any) -> None:
    """Trainer ``t``'s first words: the config (and opted-in changes) and HParams into TensorBoard,
    and the run's layout, data path and model in two log lines."""
    cfg, st = t.cfg, t.state
    from ddplab.task import logged_names

    t.writer.text("config", OmegaConf.to_yaml(cfg, resolve=True))
    if t.config_changes:
        t.writer.text("config_changes", t.config_changes)
    t.writer.hparams(hparams_of(cfg, t.run_dir, st.world_size),
                     [*(f"val/{m}" for m in logged_names(t.task)), *t.callbacks.logged_names(), "train/loss",
                      "best/" + cfg.objective])
    log.info(
        "run dir %s | %d rank(s) on %s (%s) | %s | batch: %d global = %d rank(s) x %d per rank, "
        "x %d accumulation = %d samples per optimizer step | %d steps/epoch, %d epochs",
        t.run_dir, st.world_size, st.device, st.backend or "no process group", t.precision.describe(),
        t.global_batch, st.world_size, t.sampler.per_rank_batch, t.accum, t.global_batch * t.accum,
        t.steps_per_epoch, cfg.num_epochs)
    log.info("data: %s | model: %s%s", t.train_loader.describe(), _describe_model(t),
             f" | callbacks: {', '.join(t.callbacks.describe())}" if t.callbacks.named else "")


def run_summary(t: Any, out: dict[str, float]) -> list[str]:
    """A few lines at the end of a run (rank 0 logs them; other ranks log only warnings): best
    objective and when, final metrics, time and throughput, where the checkpoints and events are,
    the command that opens TensorBoard, and a hint when validation loss ended above where it began."""
    cfg, res, obj = t.cfg, t.results, t.cfg.objective
    steps, secs = int(out.get("step", 0)), out.get("time_s", 0.0)
    samples = (steps - t.loop_start_step) * t.global_batch * t.accum
    lines = [f"done: {int(out.get('epoch', 0))}/{cfg.num_epochs} epochs, {steps} steps, {secs:.1f} s this run"
             + (f", {samples / secs:,.0f} samples/s" if secs > 0 and samples > 0 else "")]
    if res.best is not None:
        lines.append(f"best {obj}={res.best:.4g} at epoch {res.best_epoch} (step {res.best_step}); final "
                     + " ".join(f"{k}={v:.4g}" for k, v in res.last_val.items() if not k.endswith("num_samples")))
    where = t.run_dir / "checkpoints"
    lines.append(f"checkpoints: {where}" if cfg.checkpoint.get("enabled", True) else "checkpoints: none written")
    lines.append(f"TensorBoard: tensorboard --logdir {t.run_dir / 'tb'}")
    last = res.last_val.get("val/loss")
    yardsticks = [("the first logged train/loss", t.first_train_loss)]
    if res.first_val != res.last_val:  # more than one evaluation
        yardsticks.insert(0, ("its first evaluation", res.first_val.get("val/loss")))
    above = [(what, v) for what, v in yardsticks if v is not None and last is not None and last > v]
    if above:
        what, v = above[0]
        lines.append(f"hint: val/loss ended at {last:.4g}, above {what} ({v:.4g}): not converging — try a "
                     "lower optimizer.lr, more epochs, grad_clip=1.0, or amp=false")
    return lines


def _describe_model(t: Any) -> str:
    pf = t.cfg.perf
    parts = [type(t.module).__name__, f"{sum(p.numel() for p in t.params):,} params"]
    parts += ["channels_last"] * pf.channels_last + [f"compiled ({pf.compile_backend})"] * pf.compile
    parts.append("fused optimizer" if t.optimizer.defaults.get("fused") else "unfused optimizer")
    return ", ".join(parts + t.strategy.describe())


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
