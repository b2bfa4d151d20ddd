"""The trainer's checkpoints and how a run resumes: which of its parts are checkpointed
(:func:`checkpoint_manager`, :func:`register_entries`), the checkpoint's config against the current one, and —
when the user opted in with ``resume_apply_changes=true`` — new values really applied and recorded
(:func:`resume`). ``mode=eval`` takes its config from the checkpoint (:func:`eval_config`).

:meth:`ResumeGuard.check` goes to the CheckpointManager (it runs before any component
loads, so a refused checkpoint changes nothing); :meth:`ResumeGuard.apply` runs after the load.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from ddplab import redact
from ddplab.checkpoint import CheckpointManager
from ddplab.config import ConfigError, drift
from ddplab.optim import apply_hyperparameters
from ddplab.runtime.group import Dist
from ddplab.train import batch_size
from ddplab.train.hooks import Hook
from ddplab.train.state import State

log = logging.getLogger("ddplab")

GLOBAL_BATCH = "(samples per optimizer step)"
# Changing these mid-epoch would skip the wrong samples: the position is counted in micro-batches.
_POSITION_KEYS = ("batch_size", "batch_size_scope", "grad_accum_steps", GLOBAL_BATCH)
CHANGES_FILE = "config_changes.yaml"


def _samples_per_step(flat: dict[str, Any], world_size: int) -> int | None:
    """A (flattened, maybe older) config's samples per optimizer step; None where it cannot say."""
    try:
        return batch_size.per_step(
            flat["batch_size"],
            flat.get("batch_size_scope", "global"),
            world_size,
            flat.get("grad_accum_steps", 1),
        )
    except (KeyError, TypeError, ValueError):
        return None


class ResumeGuard:
    def __init__(self, cfg: DictConfig, world_size: int):
        self.cfg, self.world_size = cfg, world_size
        self.changes: list[tuple[str, Any, Any]] = []
        self.source: Path | None = None

    def check(self, meta: dict[str, Any], path: Path) -> None:
        """The CheckpointManager's ``check_meta``: refuse a checkpoint of another config (no opt-in)."""
        saved = meta.get("config", "")
        diffs = drift.differences(saved, self.cfg)
        # batch_size_scope=per_rank on another world size: same keys, different batches.
        before = _samples_per_step(drift.flatten(saved), int(meta.get("world_size", 1)))
        now = _samples_per_step(drift.flatten(self.cfg), self.world_size)
        if before != now and not any(k in _POSITION_KEYS for k, _, _ in diffs):
            diffs.append((GLOBAL_BATCH, before, now))
        self.changes, self.source = drift.check_diffs(diffs, self.cfg, str(path)), path

    def apply(
        self,
        optimizer: Any,
        scheduler: Any,
        fresh_groups: list[dict[str, Any]],
        step_in_epoch: int,
        step: int,
        run_dir: Path | None,
    ) -> str | None:
        """After the load: put the opted-in changes in force; a text for TensorBoard, or None.
        ``run_dir``: where to record them (rank 0's; None on other ranks)."""
        if not self.changes:
            return None
        moved = [k for k, _, _ in self.changes if k in _POSITION_KEYS or k.startswith("dataset.")]
        if moved and step_in_epoch:
            raise ConfigError(
                f"resume_apply_changes=true: {', '.join(moved)} changed, but {self.source} was saved "
                "mid-epoch "
                f"({step_in_epoch} steps into it), where the position in the data is counted in the old "
                "batches. "
                "Fix: resume from a checkpoint saved at an epoch's end (resume=<run "
                "dir>/checkpoints/step-N.pt), "
                "or keep those keys as they were"
            )
        apply_hyperparameters(optimizer, scheduler, fresh_groups)
        text = drift.describe(self.changes)
        log.warning(
            "resume_apply_changes=true: continuing %s at step %d with new values:\n%s",
            self.source,
            step,
            text,
        )
        if run_dir is not None:
            self._record(run_dir, step)
        return f"resumed from {self.source} at step {step} with new values:\n\n{text}"

    def _record(self, run_dir: Path, step: int) -> None:
        """Append to ``run_dir/config_changes.yaml``: one entry per resume that applied changes."""
        f = run_dir / CHANGES_FILE
        entries = list(OmegaConf.to_container(OmegaConf.load(f))) if f.is_file() else []  # type: ignore[arg-type]
        entries.append(
            {
                "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                "step": step,
                "from": str(self.source),
                "changes": {k: {"checkpoint": _plain(a), "now": _plain(b)} for k, a, b in self.changes},
            }
        )
        f.write_text(OmegaConf.to_yaml(OmegaConf.create(entries)))


def _plain(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def checkpoint_manager(
    cfg: DictConfig,
    dist: Dist,
    run_dir: Path,
    guard: ResumeGuard,
    stop: Callable[[str], None],
    saved: Callable[[str], None],
) -> CheckpointManager:
    """The job's CheckpointManager, before any entry is registered (:func:`register_entries`). ``guard``
    refuses a checkpoint of another config; ``stop(reason)``: how a failed background write stops the loop
    (the StopSignal's request); ``saved(path)``: each checkpoint once it is on disk (the callbacks'
    on_save)."""
    # Secrets masked: a checkpoint travels (exports, model cards and MLflow artifacts are made from it).
    meta = {"config": redact.config_yaml(cfg), "world_size": dist.world_size}
    return CheckpointManager(
        run_dir / "checkpoints", cfg.checkpoint, dist, meta, check_meta=guard.check, stop=stop, saved=saved
    )


def register_entries(s: State) -> None:
    """Every stateful part of the job into its CheckpointManager; the callbacks' too (after their setup)."""
    manager = s.checkpoints
    entries = {
        **s.strategy.checkpoint_entries(s.module, s.optimizer, manager),
        "scheduler": s.scheduler,
        "scaler": s.precision,
        "loop": s.loop,
        "rng": s.rng,  # every rank's streams: dropout/augmentation continue exactly
        "results": s.results,
    }
    if hasattr(s.train_loader, "state_dict"):  # a stream: where it is, its workers' state (data.streams)
        entries["data"] = s.train_loader
    for key, component in entries.items():
        manager.register(key, component)
    # a callback added since the checkpoint starts fresh
    for key, component in s.callbacks.stateful().items():
        manager.register(key, component, optional=True)


def resume(s: State, guard: ResumeGuard) -> str | None:
    """Load what ``resume`` names into the job's parts; the opted-in changes as text, or None."""
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in s.optimizer.param_groups]
    path = s.checkpoints.resume(s.cfg.resume, s.run_dir, s.search_earlier_runs)
    if path is None:
        return None
    loop = s.loop
    # Opted-in config changes go into force now; rank 0 records them in the run dir.
    changes = guard.apply(
        s.optimizer,
        s.scheduler,
        fresh,
        loop.batches_in_epoch,
        loop.step,
        s.run_dir if s.dist.is_main else None,
    )
    if loop.batches_in_epoch and s.rng.saved_world_size != s.dist.world_size:
        log.warning(
            "resuming mid-epoch on %d rank(s) from a %d-rank checkpoint: same samples in the same "
            "order, but random layers (dropout) draw new streams",
            s.dist.world_size,
            s.rng.saved_world_size,
        )
    log.info("resumed from %s: %d epoch(s), %d step(s) done", path, loop.epoch, loop.step)
    s.callbacks(Hook.ON_LOAD, s, str(path))
    return changes


# Keys mode=eval takes from the command line; everything else comes from the checkpoint's config. The
# callbacks are the run's (EMA's val_ema/* is part of its evaluation), plus any the command adds.
_EVAL_OWN = (
    "distributed",
    "perf",
    "run_dir",
    "resume",
    "mode",
    "progress",
    "limit_val_batches",
    "log_every_n_steps",
    "trust_stored_config",
    "logger",
    "mlflow",
    "redact_keys",
)


_BUILT = ("model", "dataset", "task", "callbacks", "optimizer", "scheduler")  # what a job instantiates


def eval_config(cfg: DictConfig) -> DictConfig:
    """mode=eval: the checkpoint's own config (model, data, task, callbacks, ...) with this command's
    launch settings (and any callbacks it adds), so ``python train.py mode=eval resume=<run dir>`` needs
    nothing else."""
    from ddplab.checkpoint import files

    path = files.find_resume_path(cfg.resume, Path("."))
    assert path is not None
    saved = files.load(path).get("meta", {}).get("config")
    if not saved:
        raise ConfigError(
            f"resume={cfg.resume}: {path} holds no config (meta.config). Fix: a checkpoint ddplab wrote"
        )
    from ddplab.config import trust
    from ddplab.config.typed import typed

    stored = OmegaConf.create(saved)  # parsing YAML builds nothing
    if not cfg.trust_stored_config:  # nothing the checkpoint names is imported before this check passes
        refused = trust.refusal(f"mode=eval resume={cfg.resume}", {k: stored.get(k) for k in _BUILT}, cfg)
        if refused:
            raise ConfigError(refused)
    plain = OmegaConf.to_container(stored, resolve=False)
    mine = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    plain.update({key: mine[key] for key in _EVAL_OWN if key in mine})
    plain["callbacks"] = {**(plain.get("callbacks") or {}), **(mine.get("callbacks") or {})}
    plain["resume"] = str(path)
    return typed(plain, f"resume={cfg.resume}'s stored config")
