"""What a run reports besides scalars: its HParams entry and the rank-0 progress display."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddplab import redact, rundir
from ddplab.train.length import RunLength
from ddplab.train.state import State

log = logging.getLogger("ddplab")


WIDTH = 100  # a console message's budget: the time stamp and a job tag fill the rest of 120 columns


def shown(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def wrap(head: str, items: list[str], sep: str = "  ", width: int = WIDTH) -> list[str]:
    """``head`` then ``items`` (the first after a space, the rest after ``sep``), as lines of at most
    ``width`` characters where the items allow; continuation lines indented."""
    lines, line = [], head
    for i, item in enumerate(items):
        glue = sep if i else " "
        if len(line) + len(glue) + len(item) > width and line.strip():
            lines.append(line)
            line = "  " + item
        else:
            line += glue + item
    return lines + [line]


def hparams_of(cfg: DictConfig, run_dir: Path, world_size: int) -> dict[str, Any]:
    """The HParams entry: what a sweep varies first (typed: the config's value, or the option name
    of a group), then this job's other overrides, then the key settings."""

    def short(target: Any) -> Any:
        return str(target).rsplit(".", 1)[-1] if target else target

    def typed(key: str, value: str) -> Any:
        node = OmegaConf.select(cfg, key, default=None)
        return value if isinstance(node, DictConfig) or node is None else node  # group=option: the name

    hp = {k: typed(k, v) for k, v in rundir.swept(run_dir).items()}
    for o in rundir.read_overrides(run_dir) or []:
        key, _, value = o.lstrip("+~").partition("=")
        if not (key.startswith("hydra") or key in ("resume", "stop_after_epochs", "run_dir") or key in hp):
            hp[key] = typed(key, value)
    settings: dict[str, Any] = {
        "task": short(cfg.task.get("_target_")) if cfg.get("task") else None,
        "model": short(cfg.model.get("_target_")),
        "dataset": short(cfg.dataset.get("_target_")),
        "optimizer": short(cfg.optimizer.get("_target_")),
        "optimizer.lr": cfg.optimizer.get("lr"),
        "optimizer.weight_decay": cfg.optimizer.get("weight_decay"),
        "batch_size": cfg.batch_size,
        "grad_accum_steps": cfg.grad_accum_steps,
        "num_epochs": cfg.num_epochs,
        "max_steps": cfg.max_steps,
        "amp": cfg.amp,
        "seed": cfg.seed,
        "world_size": world_size,
    }
    keys = redact.keys_of(cfg)  # an override's value is the config's: secrets masked here (ddplab.redact)
    return {
        k: redact.MASK if redact.is_secret_key(k, keys) else redact.text(v, keys) if isinstance(v, str) else v
        for k, v in {**hp, **{k: v for k, v in settings.items() if k not in hp}}.items()
        if v is not None
    }


def charts_of(s: State) -> dict[str, dict[str, list[str]]]:
    """The Custom Scalars tab: train against val for each of the task's metrics (with a callback's
    variant, e.g. val_ema/acc, and the objective's best), then the vitals, folded."""
    from ddplab.task import logged_names
    from ddplab.train.state import best_name

    obj, extra = s.cfg.objective, s.callbacks.logged_names()
    learning: dict[str, list[str]] = {}
    for m in logged_names(s.task):
        tags = [f"train/{m}", f"val/{m}", *(e for e in extra if e.split("/", 1)[-1] == m)]
        learning[f"{m}: train vs val"] = tags + [best_name(obj)] * (obj in tags)
    v = "vitals/"
    vitals = {
        "learning rate": [v + "lr"],
        "samples/s (all ranks)": [v + "samples_per_s"],
        "step time ms: mean, slowest, fastest rank": [
            v + "step_time_ms",
            v + "step_time_ms_max",
            v + "step_time_ms_min",
        ],
        "data wait ms: mean, slowest, fastest rank": [
            v + "data_time_ms",
            v + "data_time_ms_max",
            v + "data_time_ms_min",
        ],
        "epoch": [v + "epoch"],
    }
    if s.dist.device.type == "cuda":
        vitals["peak memory GB (max over ranks)"] = [v + "peak_mem_gb"]
    return {"is it learning?": learning, "vitals": vitals}


def announce(s: State) -> None:
    """The job's first words: the config, HParams and the Custom Scalars
    charts into TensorBoard; the run's ranks, batch, data path and model on the console."""
    cfg, dist = s.cfg, s.dist
    s.writer.text("config", redact.config_yaml(cfg))  # secrets masked: TensorBoard and MLflow keep it
    if "study" not in (cfg.callbacks or {}):  # a study's worker writes a trial's row with its end state
        s.writer.hparams(hparams_of(cfg, s.run_dir, dist.world_size), f"{s.run_dir.name}/{s.events_dir.name}")
    s.writer.charts(charts_of(s))
    per_step = s.samples_per_step
    lines = [
        f"run dir: {shown(s.run_dir)}",
        f"{dist.world_size} rank(s) on {dist.device} ({dist.backend or 'no process group'}) | "
        f"{s.precision.describe()} | {s.length.describe()}",
        *wrap(
            "batch:",
            [
                f"{per_step} samples per optimizer step = {dist.world_size} rank(s) x "
                f"{s.sampler.per_rank_batch} per rank x {s.accum} accumulation"
            ],
        ),
        *wrap("data:", [s.train_loader.describe()]),
        *wrap("model:", _describe_model(s), ", "),
    ]
    if s.callbacks.named:
        lines += wrap("callbacks:", s.callbacks.describe(), ", ")
    for line in lines:
        log.info("%s", line)


def run_summary(s: State, out: dict[str, float]) -> list[str]:
    """A few lines at the end of a run (rank 0 logs them; other ranks log only warnings): best
    objective and when, final metrics, time and throughput, where the checkpoints and events are,
    the command that opens TensorBoard, and a hint when validation loss ended above where it began."""
    cfg, res, obj = s.cfg, s.results, s.cfg.objective
    steps, secs = int(out.get("step", 0)), out.get("time_s", 0.0)
    samples = (steps - s.loop.start_step) * s.samples_per_step
    done = (
        f"{int(out.get('epoch', 0))}/{cfg.num_epochs} epochs, {steps} steps"
        if cfg.max_steps is None
        else f"{steps}/{s.length.total_steps} steps ({steps / s.steps_per_epoch:.3g} epochs)"
    )
    lines = [
        f"done: {done}, {secs:.1f} s this run"
        + (f", {samples / secs:,.0f} samples/s" if secs > 0 and samples > 0 else "")
    ]
    if res.best is not None:
        lines.append(f"best {obj}={res.best:.4g} at epoch {res.best_epoch} (step {res.best_step})")
        lines += wrap(
            "final:", [f"{k}={v:.4g}" for k, v in res.last_val.items() if not k.endswith("num_samples")]
        )
    where = shown(s.run_dir / "checkpoints")
    lines.append(f"checkpoints: {where}" if cfg.checkpoint.enabled else "checkpoints: none written")
    lines.append(f"events: {shown(s.events_dir)}")
    lines.append(f"open: tensorboard --logdir {shown(s.run_dir)}")
    last = res.last_val.get("val/loss")
    yardsticks = [("the first logged train/loss", s.results.first_train_loss)]
    if res.first_val != res.last_val:  # more than one evaluation
        yardsticks.insert(0, ("its first evaluation", res.first_val.get("val/loss")))
    above = [(what, v) for what, v in yardsticks if v is not None and last is not None and last > v]
    if above:
        what, v = above[0]
        lines.append(f"hint: val/loss ended at {last:.4g}, above {what} ({v:.4g}): not converging")
        amp_on = s.precision.dtype.itemsize < 4  # after amp fell back to fp32, amp=false would change nothing
        lines.append(
            "  try a lower optimizer.lr, more epochs, grad_clip=1.0" + (", or amp=false" if amp_on else "")
        )
    return lines


def _describe_model(s: State) -> list[str]:
    pf = s.cfg.perf
    parts = [type(s.module).__name__, f"{sum(p.numel() for p in s.params):,} params"]
    parts += ["channels_last"] * pf.channels_last + [f"compiled ({pf.compile_backend})"] * pf.compile
    parts.append("fused optimizer" if s.optimizer.defaults.get("fused") else "unfused optimizer")
    return parts + s.strategy.describe()


class Progress:
    """tqdm bar on a terminal, periodic log lines otherwise, nothing on other ranks. What it shows: the task's
    own train/* metrics (no placeholder for one a task does not log), the lr, samples/s (tokens/s for a task
    that counts tokens), the step time and an ETA of the training left (evaluations not counted)."""

    def __init__(self, mode: str, total: int = 0, epoch: int = 0, length: RunLength | None = None):
        self.mode, self._bar, self.length = mode, None, length
        if mode == "bar":
            from tqdm import tqdm

            epochs = length.epochs if length is not None else "?"
            self._bar = tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", leave=False, dynamic_ncols=True)

    @classmethod
    def for_rank(cls, mode: str, is_main: bool, total: int, epoch: int, length: RunLength) -> Progress:
        """``progress=auto``: a bar on a terminal, log lines otherwise; other ranks draw nothing."""
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "log"
        return cls(mode if is_main else "none", total, epoch, length)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def show(self, epoch: int, step: int, values: dict[str, float]) -> None:
        shown_metrics = {
            k[6:]: v for k, v in values.items() if k.startswith("train/") and k not in _NOT_SHOWN
        }
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown_metrics.items()}, refresh=False)
        elif self.mode == "log":
            rate = (
                f"{values['vitals/tokens_per_s']:,.0f} tokens/s"
                if "vitals/tokens_per_s" in values
                else f"{values['vitals/samples_per_s']:.0f} samples/s"
            )
            total = f"/{self.length.total_steps}" if self.length is not None else ""
            log.info(
                "epoch %d step %d%s  %s  lr=%.3g  %s  step %.1f ms (max %.1f)%s",
                epoch + 1,
                step,
                total,
                " ".join(f"{k}={v:.4g}" for k, v in shown_metrics.items()),
                values["vitals/lr"],
                rate,
                values["vitals/step_time_ms"],
                values["vitals/step_time_ms_max"],
                self._eta(step, values),
            )

    def _eta(self, step: int, values: dict[str, float]) -> str:
        """The training left at the slowest rank's pace (the job's), as 1h02m / 3m05s / 12s."""
        if self.length is None or step >= self.length.total_steps:
            return ""
        secs = round((self.length.total_steps - step) * values["vitals/step_time_ms_max"] / 1e3)
        h, m, sec = secs // 3600, secs // 60 % 60, secs % 60
        return "  ETA " + (f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_NOT_SHOWN = ("train/grad_norm", "train/fp16_skipped_steps")  # vitals of the step, not the task's metrics
