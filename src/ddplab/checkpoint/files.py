"""Checkpoint files on disk: atomic writes, rotation, safe loads, and where ``resume`` points.

A checkpoint is a plain dict of tensors, numbers and strings, so it loads with
``torch.load(weights_only=True)``: opening a file cannot run code. Only
:class:`~ddplab.checkpoint.manager.CheckpointManager` calls these (and tests).
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ddplab import rundir

log = logging.getLogger(__name__)

LAST = "last.pt"
BEST = "best.pt"
SIDECAR = "sidecar"  # a component entry {"sidecar": name}: a directory next to the .pt belongs to it


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def _link_atomic(src: Path, dst: Path) -> None:
    """Point ``dst`` at ``src``'s bytes atomically (hard link; a copy where links are unsupported)."""
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


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


def save(obj: dict[str, Any], ckpt_dir: Path, step: int, keep_last: int, is_best: bool) -> Path:
    """``step-<N>.pt`` written atomically, then ``last.pt`` (and ``best.pt``) pointed at it;
    only the newest ``keep_last`` step files are kept, with the sidecar dirs they name."""
    path = ckpt_dir / f"{step_name(step)}.pt"
    save_atomic(obj, path)
    _link_atomic(path, ckpt_dir / LAST)
    if is_best:
        _link_atomic(path, ckpt_dir / BEST)
    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-keep_last]:
        old.unlink(missing_ok=True)  # best.pt / last.pt keep their own links
    if _sidecars(obj):
        _remove_unreferenced_sidecars(ckpt_dir)
    for stale in ckpt_dir.glob(".*.tmp*"):  # left by a writer killed mid-write
        if not stale.name.endswith(f"tmp{os.getpid()}"):
            stale.unlink(missing_ok=True)
    return path


def _sidecars(obj: dict[str, Any]) -> set[str]:
    return {v[SIDECAR] for v in obj.values() if isinstance(v, dict) and SIDECAR in v}


def _remove_unreferenced_sidecars(ckpt_dir: Path) -> None:
    """Drop ``step-N.*/`` directories that no remaining ``.pt`` (step files, last, best) names."""
    keep: set[str] = set()
    for pt in list(ckpt_dir.glob("step-*.pt")) + [ckpt_dir / LAST, ckpt_dir / BEST]:
        if pt.is_file():
            try:
                keep |= _sidecars(torch.load(pt, map_location="cpu", weights_only=True))
            except Exception:  # unreadable: keep everything rather than guess
                return
    for d in ckpt_dir.glob("step-*"):
        if d.is_dir() and d.name not in keep:
            shutil.rmtree(d, ignore_errors=True)


def load(path: Path, device: torch.device) -> dict[str, Any]:
    """Load onto this rank's own device (never onto the GPU that saved it)."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"resume: checkpoint {path} does not exist. Fix: pass resume=auto or a valid path.")
    except Exception as e:
        raise RuntimeError(f"resume: cannot read checkpoint {path} (truncated or corrupt?): "
                           f"{type(e).__name__}: {str(e)[:200]}") from e


def load_first_good(candidates: list[Path], device: torch.device) -> tuple[Path, dict[str, Any]] | None:
    """The first candidate that loads; a corrupt one is reported and skipped (resume=auto)."""
    for p in candidates:
        try:
            return p, load(p, device)
        except (RuntimeError, FileNotFoundError) as e:
            log.warning("%s; trying the previous checkpoint", e)
    return None


def _newest_first(ckpt_dir: Path) -> list[Path]:
    """last.pt, then the step files newest first (fallbacks if last.pt is unreadable)."""
    steps = sorted(ckpt_dir.glob("step-*.pt"), reverse=True)
    return ([ckpt_dir / LAST] if (ckpt_dir / LAST).is_file() else []) + steps


def _same_run_key(run_dir: Path) -> list[str] | None:
    """The overrides that make two invocations "the same run" (how long each runs does not)."""
    overrides = rundir.read_overrides(run_dir)
    if overrides is None:
        return None
    return sorted(o for o in overrides if not o.startswith(("resume=", "stop_after_epochs=")))


def find_resume(resume: str | None, run_dir: Path, search: bool = False) -> list[Path]:
    """All checkpoints to try, best candidate first (see :func:`find_resume_path`)."""
    first = find_resume_path(resume, run_dir, search)
    if first is None:
        return []
    if resume != "auto":
        return [first]
    return _newest_first(first.parent)


def find_resume_path(resume: str | None, run_dir: Path, search: bool = False) -> Path | None:
    """The checkpoint to continue from, or None to start fresh.

    ``resume=auto`` takes ``last.pt`` of this run dir; with ``search`` (a run dir
    Hydra made up), else that of the newest earlier run under the same output
    root launched with the same overrides (so re-typing the same command plus
    ``resume=auto`` continues it; a sweep's jobs each find their own earlier job,
    and finished ones end at once). A run dir someone named — ``run_dir=``,
    ``hydra.run.dir=``, a torchrun restart's — is the only place looked in.
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
    own = _newest_first(run_dir / "checkpoints")
    if own:
        return own[0]
    if not search:
        return None
    mine = _same_run_key(run_dir)
    if mine is None:
        return None
    # Earlier runs: outputs/<date>/<time> (single runs) and multirun/<date>/<time>/<num> (sweeps).
    found = set(glob.glob(str(run_dir.parent.parent / "*" / "*" / "checkpoints" / "*.pt")))
    found |= set(glob.glob(str(run_dir.parent.parent.parent / "*" / "*" / "*" / "checkpoints" / "*.pt")))
    candidates = sorted((Path(p) for p in found), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in candidates:
        if p.parent.parent != run_dir and _same_run_key(p.parent.parent) == mine:
            log.info("resume=auto: continuing %s", p.parent.parent)
            return _newest_first(p.parent)[0]
    log.info("resume=auto: no earlier run with overrides %s; starting fresh", mine)
    return None
