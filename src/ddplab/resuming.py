"""What a resume may change: the checkpoint's config against the current one, and — when the
user opted in with ``resume_apply_changes=true`` — new values really applied and recorded.

The trainer hands :meth:`ResumeGuard.check` to the CheckpointManager (it runs before any
component loads, so a refused checkpoint changes nothing) and calls :meth:`ResumeGuard.apply`
after the load.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddplab.config import ConfigError, drift
from ddplab.optim import apply_hyperparameters

log = logging.getLogger("ddplab")

GLOBAL_BATCH = "(samples per optimizer step)"
# Changing these mid-epoch would skip the wrong samples: the position is counted in micro-batches.
_POSITION_KEYS = ("batch_size", "batch_size_scope", "grad_accum_steps", GLOBAL_BATCH)
CHANGES_FILE = "config_changes.yaml"


def _samples_per_step(flat: dict[str, Any], world_size: int) -> int | None:
    try:
        per_rank = flat.get("batch_size_scope") == "per_rank"
        return int(flat["batch_size"]) * (world_size if per_rank else 1) * int(flat.get("grad_accum_steps", 1))
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

    def apply(self, optimizer: Any, scheduler: Any, fresh_groups: list[dict[str, Any]], step_in_epoch: int,
              step: int, run_dir: Path | None) -> str | None:
        """After the load: put the opted-in changes in force; a text for TensorBoard, or None.
        ``run_dir``: where to record them (rank 0's; None on other ranks)."""
        if not self.changes:
            return None
        moved = [k for k, _, _ in self.changes if k in _POSITION_KEYS or k.startswith("dataset.")]
        if moved and step_in_epoch:
            raise ConfigError(
                f"resume_apply_changes=true: {', '.join(moved)} changed, but {self.source} was saved mid-epoch "
                f"({step_in_epoch} steps into it), where the position in the data is counted in the old batches. "
                "Fix: resume from a checkpoint saved at an epoch's end (resume=<run dir>/checkpoints/step-N.pt), "
                "or keep those keys as they were")
        apply_hyperparameters(optimizer, scheduler, fresh_groups)
        text = drift.describe(self.changes)
        log.warning("resume_apply_changes=true: continuing %s at step %d with new values:\n%s",
                    self.source, step, text)
        if run_dir is not None:
            self._record(run_dir, step)
        return f"resumed from {self.source} at step {step} with new values:\n\n{text}"

    def _record(self, run_dir: Path, step: int) -> None:
        """Append to ``run_dir/config_changes.yaml``: one entry per resume that applied changes."""
        f = run_dir / CHANGES_FILE
        entries = list(OmegaConf.to_container(OmegaConf.load(f))) if f.is_file() else []  # type: ignore[arg-type]
        entries.append({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "step": step, "from": str(self.source),
                        "changes": {k: {"checkpoint": _plain(a), "now": _plain(b)} for k, a, b in self.changes}})
        f.write_text(OmegaConf.to_yaml(OmegaConf.create(entries)))


def _plain(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
