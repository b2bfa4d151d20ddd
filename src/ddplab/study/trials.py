"""What a study's trial is made of, as every worker and rank computes it alike: where the study lives, the
sampler that proposes trial ``n``, and the trial's own config (the worker's, with the trial's params, run in
the trial's dir and reporting to the study)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf, open_dict

from ddplab.config.errors import ConfigError

TRIAL_FILE = "trial.json"  # in the trial's run dir: study, number, params (rundir.swept reads it)

# How a trained trial ended, to be told: its config, run dir, outcome, objective value and metrics.
Ended = tuple[DictConfig, Path, str, "float | None", dict[str, float]]


def where(cfg: DictConfig) -> tuple[Path, str]:
    """The study's dir (absolute) and its storage URL, as every worker and rank computes them."""
    from ddplab.study.storage import default_url

    study_dir = Path(str(cfg.study.dir)).absolute()
    return study_dir, str(cfg.study.storage or default_url(study_dir))


def make_sampler(cfg: DictConfig, space: dict[str, Any], n: int) -> Any:
    """``study.sampler`` seeded for trial number ``n`` (the same study samples the same params whichever
    worker asks); a GridSampler without a ``search_space`` gets the choices of ``study.params``, as in
    Hydra's Optuna sweeper."""
    from hydra.utils import instantiate

    # a mapping: the schema's
    spec = dict(cast(dict, OmegaConf.to_container(cfg.study.sampler, resolve=True)))
    spec["seed"] = int(spec.get("seed", cfg.seed)) + n
    if str(spec.get("_target_", "")).endswith("GridSampler") and "search_space" not in spec:
        spec["search_space"] = {k: list(getattr(d, "choices", ())) for k, d in space.items()}
        ranges = [k for k, d in space.items() if not hasattr(d, "choices")]
        if ranges:
            raise ConfigError(
                f"study.sampler=GridSampler needs choices: study.params.{ranges[0]} is a range. Fix: "
                f"choice(...) or range(lo, hi, step) for it, or another sampler"
            )
    return instantiate(spec)


def trial_config(cfg: DictConfig, number: int, params: dict[str, Any], tdir: str) -> DictConfig:
    """The worker's config with trial ``number``'s params, as a normal run in the trial's dir ``tdir`` that
    reports to the study. Recomposed by Hydra where it runs (a param may pick a group option: model=mlp)."""
    url = where(cfg)[1]
    settings = {"mode": "train", "run_dir": str(tdir), "resume": "auto"}
    out = _compose(params, settings) or _updated(cfg, params, settings)
    with open_dict(out):
        out.callbacks = out.get("callbacks") or {}
        out.callbacks.study = {
            "_target_": "ddplab.study.report.ReportToStudy",
            "storage": url,
            "study_name": str(cfg.study.name),
            "trial": number,
            "objective": out.objective,
            "pruner": OmegaConf.to_container(out.study.pruner) if out.study.pruner else None,
            "timeout_s": out.study.timeout_s,
        }
    return out


def _compose(params: dict[str, Any], settings: dict[str, Any]) -> DictConfig | None:
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    if not (GlobalHydra.instance().is_initialized() and HydraConfig.initialized()):
        return None
    from hydra import compose

    hc = HydraConfig.get()
    ours = {k: _override_value(v) for k, v in {**params, **settings}.items()}
    given = [o for o in hc.overrides.task if o.lstrip("+~").split("=", 1)[0] not in ours]
    return compose(config_name=hc.job.config_name, overrides=given + [f"{k}={v}" for k, v in ours.items()])


def _override_value(v: Any) -> str:
    """``v`` in Hydra's override grammar, meaning exactly ``v``: a string is quoted (a space, ``#``, ``,`` or
    ``=`` in a path is grammar otherwise) and its ``${`` escaped (OmegaConf would interpolate it)."""
    from hydra.core.override_parser.types import Quote, QuotedString

    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return QuotedString(text=v.replace("${", "\\${"), quote=Quote.single).with_quotes()
    return str(v)


def _updated(cfg: DictConfig, params: dict[str, Any], settings: dict[str, Any]) -> DictConfig:
    """Without Hydra (ddplab.study called from Python): set the values in a copy; a group option cannot be."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        for k, v in {**params, **settings}.items():
            if isinstance(OmegaConf.select(out, k), DictConfig):
                raise ConfigError(
                    f"study.params.{k}: choosing a group option needs train.py (Hydra composes it). "
                    "Fix: run the study through train.py mode=study"
                )
            OmegaConf.update(out, k, v, merge=False)
    return out


def objective_value(metrics: dict[str, Any], objective: str) -> float | None:
    v = metrics.get(objective)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
