"""What a run dir holds besides checkpoints and event files, read and written in one place:
where it is, Hydra's record of the overrides, and ``result.json`` (how the job ended)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

RESULT = "result.json"


def own_run_dir(cfg: Any) -> Path:
    """This process's idea of the run dir: explicit, else Hydra's output dir, else outputs/<date>/<time>."""
    if cfg.get("run_dir"):
        return Path(cfg.run_dir).absolute()
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir).absolute()
    return (Path("outputs") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")).absolute()


def read_overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides Hydra recorded for this run (``.hydra/overrides.yaml``), or None."""
    f = run_dir / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return None
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(f)]


def write_result(run_dir: Path, result: dict[str, Any]) -> None:
    """``run_dir/result.json``: how the job ended (status, metrics or error), written atomically."""
    tmp = run_dir / f".{RESULT}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, run_dir / RESULT)


def read_result(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / RESULT).read_text())
    except (OSError, ValueError):
        return None
