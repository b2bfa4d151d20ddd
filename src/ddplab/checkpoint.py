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
BEST = "best.pt"


# ------------------------------------------------------------------ RNG state
def rng_state() -> dict[str, Any]:
    """This process's random streams, as plain lists/tensors (loadable with weights_only=True)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])


# --------------------------------------------------------------- saving
def _link_atomic(src: Path, dst: Path) -> None:
    """Point ``dst`` at ``src``'s bytes atomically (hard link; a copy where links are unsupported)."""
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        import shutil

        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def save(obj: dict[str, Any], ckpt_dir: Path, step: int, keep_last: int, is_best: bool) -> Path:
    """``step-<N>.pt`` written atomically, then ``last.pt`` (and ``best.pt``) pointed at it;
    only the newest ``keep_last`` step files are kept."""
    path = ckpt_dir / f"step-{step:08d}.pt"
    save_atomic(obj, path)
    _link_atomic(path, ckpt_dir / LAST)
    if is_best:
        _link_atomic(path, ckpt_dir / BEST)
    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-keep_last]:
        old.unlink(missing_ok=True)  # best.pt / last.pt keep their own links
    if "sharded" in obj:
        _remove_unreferenced_shards(ckpt_dir)
    for stale in ckpt_dir.glob(".*.tmp*"):  # left by a writer killed mid-write
        if not stale.name.endswith(f"tmp{os.getpid()}"):
            stale.unlink(missing_ok=True)
    return path


# ---------------------------------------------------- sharded (distributed=fsdp)
def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Every rank writes its shards of model + optimizer into the directory ``path``
    (torch.distributed.checkpoint); collective. The small ``.pt`` that names it is written after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Read this rank's shards back (any world size: DCP reshards on load); collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (path / ".metadata").is_file():
        raise RuntimeError(f"resume: sharded checkpoint {path} is missing or incomplete (no .metadata)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _remove_unreferenced_shards(ckpt_dir: Path) -> None:
    """Drop ``step-N.dcp/`` directories that no remaining ``.pt`` (step files, last, best) names."""
    import shutil

    keep = set()
    for pt in list(ckpt_dir.glob("step-*.pt")) + [ckpt_dir / LAST, ckpt_dir / BEST]:
        if pt.is_file():
            try:
                keep.add(torch.load(pt, map_location="cpu", weights_only=True).get("sharded"))
            except Exception:  # unreadable: keep everything rather than guess
                return
    for d in ckpt_dir.glob("step-*.dcp"):
        if d.name not in keep:
            shutil.rmtree(d, ignore_errors=True)


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
        raise RuntimeError(f"resume: cannot read checkpoint {path} (truncated or corrupt?): "
                           f"{type(e).__name__}: {str(e)[:200]}") from e


def _overrides(run_dir: Path) -> list[str] | None:
    f = run_dir / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return None
    from omegaconf import OmegaConf

    # How long this invocation runs is not what makes it "the same run".
    return sorted(o for o in OmegaConf.load(f) if not str(o).startswith(("resume=", "stop_after_epochs=")))


def _newest_first(ckpt_dir: Path) -> list[Path]:
    """last.pt, then the step files newest first (fallbacks if last.pt is unreadable)."""
    steps = sorted(ckpt_dir.glob("step-*.pt"), reverse=True)
    return ([ckpt_dir / LAST] if (ckpt_dir / LAST).is_file() else []) + steps


def load_first_good(candidates: list[Path], device: torch.device) -> tuple[Path, dict[str, Any]] | None:
    """The first candidate that loads; a corrupt one is reported and skipped (resume=auto)."""
    for p in candidates:
        try:
            return p, load(p, device)
        except (RuntimeError, FileNotFoundError) as e:
            log.warning("%s; trying the previous checkpoint", e)
    return None


def find_resume(resume: str | None, run_dir: Path) -> list[Path]:
    """All checkpoints to try, best candidate first (see :func:`find_resume_path`)."""
    first = find_resume_path(resume, run_dir)
    if first is None:
        return []
    if resume != "auto":
        return [first]
    return _newest_first(first.parent)


def find_resume_path(resume: str | None, run_dir: Path) -> Path | None:
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
    own = _newest_first(run_dir / "checkpoints")
    if own:
        return own[0]
    mine = _overrides(run_dir)
    if mine is None:
        return None
    # Earlier runs: outputs/<date>/<time> (single runs) and multirun/<date>/<time>/<num> (sweeps).
    found = set(glob.glob(str(run_dir.parent.parent / "*" / "*" / "checkpoints" / "*.pt")))
    found |= set(glob.glob(str(run_dir.parent.parent.parent / "*" / "*" / "*" / "checkpoints" / "*.pt")))
    candidates = sorted((Path(p) for p in found), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in candidates:
        if p.parent.parent != run_dir and _overrides(p.parent.parent) == mine:
            log.info("resume=auto: continuing %s", p.parent.parent)
            return _newest_first(p.parent)[0]
    log.info("resume=auto: no earlier run with overrides %s; starting fresh", mine)
    return None


def load_model_state(module: torch.nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """load_state_dict with an error that lists what does not fit (another model's checkpoint)."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                    for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or shapes:
        def few(xs: list[str]) -> str:
            return ", ".join(xs[:8]) + (f" (+{len(xs) - 8} more)" if len(xs) > 8 else "")

        parts = [f"shape mismatch: {few(shapes)}" if shapes else "", f"missing: {few(missing)}" if missing else "",
                 f"unexpected: {few(unexpected)}" if unexpected else ""]
        raise RuntimeError(f"resume: checkpoint {path} does not fit this model ({'; '.join(p for p in parts if p)}). "
                           "Fix: resume with the model config it was saved with (see its 'config' entry), "
                           "or resume=null to start fresh.")
    module.load_state_dict(state)
