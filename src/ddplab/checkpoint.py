"""Checkpoint files: atomic writes by rank 0, safe loads on every rank.

A checkpoint is a plain dict of tensors, numbers and strings, so it loads with
``torch.load(weights_only=True)``: opening a file cannot run code.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

LAST = "last.pt"


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    """Write to a temporary file, fsync, rename: a crash mid-write leaves the old file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def write_result(run_dir: Path, result: dict[str, Any]) -> None:
    """``run_dir/result.json``: how the job ended (status, metrics or error), written atomically."""
    tmp = run_dir / f".result.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, run_dir / "result.json")


def read_result(run_dir: Path) -> dict[str, Any] | None:
    f = run_dir / "result.json"
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def load(path: Path, device: torch.device) -> dict[str, Any]:
    """Load onto this rank's own device (never onto the GPU that saved it)."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"resume: checkpoint {path} does not exist. Fix: pass resume=auto or a valid path.")
    except Exception as e:
        raise RuntimeError(f"resume: cannot read checkpoint {path} (truncated or corrupt?): {e}") from e


def _overrides(run_dir: Path) -> list[str] | None:
    f = run_dir / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return None
    from omegaconf import OmegaConf

    # How long this invocation runs is not what makes it "the same run".
    return sorted(o for o in OmegaConf.load(f) if not str(o).startswith(("resume=", "stop_after_epochs=")))


def find_resume(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint to continue from, or None to start fresh.

    ``resume=auto`` takes ``last.pt`` of this run dir, else of the newest earlier
    run under the same output root launched with the same overrides (so
    re-typing the same command plus ``resume=auto`` continues it; a sweep's
    jobs each find their own earlier job, and finished ones end at once).
    """
    if not resume:
        return None
    if resume != "auto":
        p = Path(resume)
        p = p / "checkpoints" / LAST if p.is_dir() else p
        if not p.is_file():
            raise FileNotFoundError(f"resume={resume}: no checkpoint at {p}. "
                                    "Fix: pass an existing .pt file or run dir, or resume=auto.")
        return p
    own = run_dir / "checkpoints" / LAST
    if own.is_file():
        return own
    mine = _overrides(run_dir)
    if mine is None:
        return None
    # Earlier runs: outputs/<date>/<time> (single runs) and multirun/<date>/<time>/<num> (sweeps).
    found = set(glob.glob(str(run_dir.parent.parent / "*" / "*" / "checkpoints" / LAST)))
    found |= set(glob.glob(str(run_dir.parent.parent.parent / "*" / "*" / "*" / "checkpoints" / LAST)))
    candidates = sorted((Path(p) for p in found), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in candidates:
        if p.parent.parent != run_dir and _overrides(p.parent.parent) == mine:
            log.info("resume=auto: continuing %s", p.parent.parent)
            return p
    log.info("resume=auto: no earlier run with overrides %s; starting fresh", mine)
    return None
