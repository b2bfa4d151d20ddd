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
from ddplab.config import drift
from ddplab.errors import InputError, ResourceError

log = logging.getLogger(__name__)

LAST = "last.pt"
BEST = "best.pt"
SIDECAR = "sidecar"  # a component entry {"sidecar": name}: a directory next to the .pt belongs to it


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def newest_step(ckpt_dir: Path) -> int | None:
    """The step of the newest ``step-<N>.pt`` in ``ckpt_dir`` (None: none there)."""
    steps = [int(p.stem[5:]) for p in ckpt_dir.glob("step-*.pt") if p.stem[5:].isdigit()]
    return max(steps, default=None)


def _link_atomic(src: Path, dst: Path) -> None:
    """Point ``dst`` at ``src``'s bytes atomically (hard link; a copy where links are unsupported)."""
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


class CheckpointWriteError(ResourceError):
    """A checkpoint could not be written (full disk, quota, permissions); the message says where and why."""


class CheckpointReadError(InputError, RuntimeError):
    """A checkpoint to resume from cannot be read (truncated, corrupt): a file the job reads, said in one line
    with exit 2 (a RuntimeError too, as it was before it had a class). Every rank reads the same file and
    meets the same error: rank 0 alone says it."""

    alike_on_every_rank = True


def free_space(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MiB free"
    except OSError:
        return "free space unknown"


class _WriteErrors:
    """The file torch.save writes through, keeping the first OSError a write raised: torch reports it only as
    "enforce fail at inline_container.cc ... unexpected pos", which hides ENOSPC, EDQUOT or EIO."""

    def __init__(self, f: Any):
        self.f, self.error = f, None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    """Write to a temporary file, fsync, rename: a crash mid-write leaves the old file intact.

    A failed write (ENOSPC, EDQUOT, EIO) removes its temporary file at once — a partial
    checkpoint left behind would keep the disk full for every retry — and raises
    :class:`CheckpointWriteError` naming the path and the space left.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    out: _WriteErrors | None = None
    try:
        with open(tmp, "wb") as f:
            out = _WriteErrors(f)
            torch.save(obj, out)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError too
        tmp.unlink(missing_ok=True)
        cause = (out.error if out is not None else None) or e
        raise CheckpointWriteError(
            f"could not write checkpoint {path}: {type(cause).__name__}: {cause} ({free_space(path.parent)} "
            "on its "
            "file system). The previous checkpoint is intact. Fix: free space (or point run_dir elsewhere), "
            "then run the same command with resume=auto"
        ) from e
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


def load(path: Path) -> dict[str, Any]:
    """Load onto the CPU. Each part then goes where its owner puts it: the weights and the optimizer's state
    onto the parameters' device (load_state_dict copies), Adam's ``step`` counts stay on the host as torch
    keeps them (on the GPU, the per-tensor kernels read each with a sync every step), generator states stay
    the CPU tensors torch requires; and the whole checkpoint never sits on the GPU beside the model."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"resume: checkpoint {path} does not exist. Fix: pass resume=auto or a valid path."
        )
    except Exception as e:
        raise CheckpointReadError(
            f"resume: cannot read checkpoint {path} (truncated or corrupt?): "
            f"{type(e).__name__}: {str(e)[:200]}"
        ) from e


def load_first_good(candidates: list[Path]) -> tuple[Path, dict[str, Any]] | None:
    """The first candidate that loads; a corrupt one is reported and skipped (resume=auto)."""
    for p in candidates:
        try:
            return p, load(p)
        except (CheckpointReadError, FileNotFoundError) as e:
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


def find_resume(
    resume: str | None, run_dir: Path, search: bool = False, digest: str | None = None
) -> list[Path]:
    """All checkpoints to try, best candidate first (see :func:`find_resume_path`)."""
    first = find_resume_path(resume, run_dir, search, digest)
    if first is None:
        return []
    if resume != "auto":
        return [first]
    return _newest_first(first.parent)


def _trains_the_same(ckpt: Path, digest: str | None) -> bool:
    """The checkpoint's own config trains what ``digest`` describes (same trajectory keys)."""
    if digest is None:
        return True
    try:
        meta = torch.load(ckpt, map_location="cpu", weights_only=True).get("meta", {})
        return drift.trajectory_digest(meta.get("config", "")) == digest
    except Exception as e:  # unreadable or foreign: not ours to continue
        log.warning(
            "resume=auto: skipping %s, which cannot be read as a checkpoint (%s: %s)",
            ckpt,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return False


def _run_key_or_none(run_dir: Path) -> list[str] | None:
    """:func:`_same_run_key` of another run; a malformed ``overrides.yaml`` there is skipped, said once."""
    try:
        key = _same_run_key(run_dir)
        return key if key is None or all(isinstance(o, str) for o in key) else None
    except Exception as e:  # another job's file: half-written, edited by hand, not YAML
        log.warning(
            "resume=auto: skipping %s, which cannot be read (%s: %s)",
            run_dir / ".hydra" / "overrides.yaml",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:  # removed since the glob (that run's keep_last rotation)
        return -1.0


def _earlier_runs(run_dir: Path) -> list[Path]:
    """Checkpoints of the other runs under this run's own outputs/ or multirun/ root, newest first.

    Hydra's default dirs are ``outputs/<date>/<time>`` (single runs) and
    ``multirun/<date>/<time>/<job num>`` (sweeps): a job number names a sweep job, whose root is
    one level further up. Never a different root: a single run does not continue a sweep job.
    """
    sweep_job = run_dir.name.isdigit()
    depth = 2 if sweep_job else 1
    if len(run_dir.parents) <= depth:
        return []
    root = run_dir.parents[depth]
    pattern = ("*", "*", "*") if sweep_job else ("*", "*")
    found = glob.glob(str(root.joinpath(*pattern, "checkpoints", "*.pt")))
    return sorted((Path(p) for p in found if Path(p).parent.parent != run_dir), key=_mtime, reverse=True)


def find_resume_path(
    resume: str | None, run_dir: Path, search: bool = False, digest: str | None = None
) -> Path | None:
    """The checkpoint to continue from, or None to start fresh.

    ``resume=auto`` takes ``last.pt`` of this run dir; with ``search`` (a run dir
    Hydra made up), else that of the newest earlier run under the same output
    root launched with the same overrides and whose checkpoint's config has the same
    trajectory ``digest`` (:func:`ddplab.config.drift.trajectory_digest`), so re-typing the same
    command plus ``resume=auto`` continues it; a sweep's jobs each find their own
    earlier job, and finished ones end at once. A run dir someone named —
    ``run_dir=``, ``hydra.run.dir=``, a torchrun restart's — is the only place looked in.
    """
    if not resume:
        return None
    if resume != "auto":
        p = Path(resume)
        p = p / "checkpoints" / LAST if p.is_dir() else p
        if not p.is_file():
            raise FileNotFoundError(
                f"resume={resume}: no checkpoint at {p}. "
                "Fix: pass an existing .pt file or run dir, or resume=auto."
            )
        return p
    own = _newest_first(run_dir / "checkpoints")
    if own:
        return own[0]
    if not search:
        return None
    mine = _same_run_key(run_dir)
    if mine is None:
        return None
    seen: set[Path] = set()
    for p in _earlier_runs(run_dir):
        other = p.parent.parent
        if other in seen:
            continue
        seen.add(other)
        newest = _newest_first(p.parent)
        if newest and _run_key_or_none(other) == mine and _trains_the_same(newest[0], digest):
            log.info("resume=auto: continuing %s", other)
            return newest[0]
    log.info("resume=auto: no earlier run with overrides %s and this config; starting fresh", mine)
    return None
