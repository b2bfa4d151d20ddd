"""A study worker's first act, on rank 0 before any trial is asked: what every trial would fail on is checked
once (the objective, the space, the sampler and pruner), and the study is opened, or created, in its storage —
refused when its trials would train or report otherwise than this worker's (``storage.open_study``)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig

from ddplab.config.errors import ConfigError
from ddplab.study import owner, space, storage
from ddplab.study.ranks import trial_world_size
from ddplab.study.trials import make_sampler, where

log = logging.getLogger("ddplab")


class OpenStudy(NamedTuple):
    study: Any  # optuna.Study
    space: dict[str, Any]  # the searched params (study.space.parse)
    dir: Path  # study.dir, absolute
    url: str  # the storage's URL
    minimize: bool  # the objective's direction
    limit: int  # trials to ask for: study.n_trials, at most a GridSampler's grid


def open_study(cfg: DictConfig) -> OpenStudy:
    minimize = _check_objective(cfg)
    searched = space.parse(cfg.study.params, cfg)
    study_dir, url = where(cfg)
    study_dir.mkdir(parents=True, exist_ok=True)
    for key in ("sampler", "pruner"):  # a typo here would fail every trial: say it once, now
        _check_target(cfg, key, searched)
    with owner.claim_lock(url, cfg.study.timeout_s, study_dir):
        store = storage.open_storage(url, cfg.study.timeout_s)
        study = storage.open_study(
            store,
            url,
            str(cfg.study.name),
            "minimize" if minimize else "maximize",
            space.signature(searched),
            str(cfg.objective),
            storage.training(cfg, searched, trial_world_size(cfg)),
        )
    log.info(
        "study %s: %s, %d trials, %s %s; trials in %s",
        cfg.study.name,
        url,
        cfg.study.n_trials,
        "minimizing" if minimize else "maximizing",
        cfg.objective,
        study_dir,
    )
    limit = int(cfg.study.n_trials)
    if str((cfg.study.sampler or {}).get("_target_", "")).endswith("GridSampler"):
        grid = math.prod(len(getattr(d, "choices", ())) for d in searched.values())
        limit = min(limit, grid)  # as Hydra's sweeper does: a grid point is not run twice
    return OpenStudy(study, searched, study_dir, url, minimize, limit)


def _check_target(cfg: DictConfig, key: str, searched: dict[str, Any]) -> None:
    spec = cfg.study.get(key)
    if not spec:
        return
    from hydra.utils import instantiate

    try:
        make_sampler(cfg, searched, 0) if key == "sampler" else instantiate(spec)
    except ConfigError:
        raise
    except Exception as e:
        why = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"study.{key}: cannot make it ({why}). Fix: a _target_ such as "
            f"{'optuna.samplers.TPESampler' if key == 'sampler' else 'optuna.pruners.MedianPruner'} "
            f"and its arguments, or study.{key}=null"
        ) from None


def _check_objective(cfg: DictConfig) -> bool:
    """The trainer's check, before any trial: an objective nothing logs would fail every trial. Minimised?"""
    from ddplab import build
    from ddplab.task import check_objective
    from ddplab.train.hooks import Callbacks

    return check_objective(
        str(cfg.objective), build.task(cfg), Callbacks(build.callbacks(cfg)).logged_names()
    )
