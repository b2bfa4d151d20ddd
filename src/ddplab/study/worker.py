"""One worker of a study: claim a trial (a RUNNING one nobody holds, else a new one asked of the sampler),
train it as a normal ddplab run in ``<study.dir>/<number>/``, tell its result once, repeat.

Who holds a trial is a file lock (``flock`` on ``<trial dir>/.ddplab.trial.lock``) taken for as long as the
worker works on it, tell included. The kernel drops it when the worker dies, however it dies, so a trial
whose lock is free while the study still says RUNNING lost its worker: preempted (its run dir says so and
holds the checkpoint) or killed. The next worker to look resumes it in place, from its last checkpoint
(resume=auto), and tells it once. Optuna's own heartbeat is not used: it would fail a preempted trial
that is about to resume, and the journal storage has none. Asking and claiming happen under one lock on
``<study.dir>/.ask.lock``, so ``study.n_trials`` is exact however many workers start at once.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf, open_dict

from ddplab import rundir
from ddplab.config.errors import ConfigError

log = logging.getLogger("ddplab")

DEATHS = "ddplab:deaths"  # trial user attr: how often its worker died before recording anything
TRIAL_FILE = "trial.json"  # in the trial's run dir: study, number, params (rundir.swept reads it)


class TrialClaim(rundir.RunDirLock):
    """The worker's hold on a trial, beside the job's own run-dir lock (which a job releases when it
    ends, before its worker has told the result)."""

    NAME = ".ddplab.trial.lock"


@dataclass
class Worker:
    cfg: DictConfig
    dir: Path  # study.dir, absolute
    url: str
    study: Any  # optuna.Study
    space: dict[str, Any]
    minimize: bool
    limit: int  # trials to ask for: study.n_trials, at most a GridSampler's grid


@contextlib.contextmanager
def ask_lock(study_dir: Path) -> Iterator[None]:
    """Workers take turns to open the study and to claim or ask (a dead holder's lock goes with it)."""
    fd = os.open(study_dir / ".ask.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def next_trial(w: Worker) -> tuple[Any, TrialClaim] | None:
    """The trial this worker takes next (held by the returned claim), or None when the study needs no more."""
    from optuna.trial import TrialState

    with ask_lock(w.dir):
        trials = w.study.get_trials(deepcopy=False)
        for t in trials:
            if t.state == TrialState.RUNNING:
                claim = _claim(w.dir / str(t.number))
                if claim is not None and not _gave_up(w, t, claim):
                    log.info("trial %d: resuming it (its worker stopped; %s)", t.number, _why_free(w.dir / str(t.number)))
                    return t, claim
        if len(trials) >= w.limit:
            return None
        w.study.sampler = make_sampler(w.cfg, w.space, len(trials))
        trial = w.study.ask(w.space)
        tdir = w.dir / str(trial.number)
        claim = _claim(tdir)
        assert claim is not None, f"{tdir} is held by another worker, though its trial was just asked"
        (tdir / TRIAL_FILE).write_text(json.dumps({"study": w.study.study_name, "number": trial.number,
                                                  "params": trial.params}, indent=2))
        return w.study.get_trials(deepcopy=False)[trial.number], claim


def make_sampler(cfg: DictConfig, space: dict[str, Any], n: int) -> Any:
    """``study.sampler`` seeded for trial number ``n`` (the same study samples the same params whichever
    worker asks); a GridSampler without a ``search_space`` gets the choices of ``study.params``, as in
    Hydra's Optuna sweeper."""
    from hydra.utils import instantiate

    spec = dict(OmegaConf.to_container(cfg.study.sampler, resolve=True))  # type: ignore[arg-type]
    spec["seed"] = int(spec.get("seed", cfg.seed)) + n
    if str(spec.get("_target_", "")).endswith("GridSampler") and "search_space" not in spec:
        spec["search_space"] = {k: list(getattr(d, "choices", ())) for k, d in space.items()}
        ranges = [k for k, d in space.items() if not hasattr(d, "choices")]
        if ranges:
            raise ConfigError(f"study.sampler=GridSampler needs choices: study.params.{ranges[0]} is a range. Fix: "
                              f"choice(...) or range(lo, hi, step) for it, or another sampler")
    return instantiate(spec)


def _claim(tdir: Path) -> TrialClaim | None:
    tdir.mkdir(parents=True, exist_ok=True)
    claim = TrialClaim(tdir)
    return claim if claim.acquire() is None else None


def _why_free(tdir: Path) -> str:
    result = rundir.read_result(tdir) or {}
    return f"preempted at step {result.get('step')}" if result.get("status") == "preempted" else "it died"


def _gave_up(w: Worker, trial: Any, claim: TrialClaim) -> bool:
    """Count a death (no preemption recorded); past ``study.max_retries`` deaths the trial fails."""
    from ddplab import compat

    tdir = w.dir / str(trial.number)
    if (rundir.read_result(tdir) or {}).get("status") == "preempted":
        return False
    deaths = int(trial.user_attrs.get(DEATHS, 0)) + 1
    compat.optuna_trial(w.study, trial.number).set_user_attr(DEATHS, deaths)
    if deaths <= w.cfg.study.max_retries:
        return False
    why = f"its worker died {deaths} times without recording a result (study.max_retries={w.cfg.study.max_retries})"
    log.error("trial %d: failed: %s", trial.number, why)
    tell(w, trial, "FAIL", None, why)
    claim.release()
    return True


def tell(w: Worker, trial: Any, state: str, value: float | None, error: str = "") -> None:
    """Tell the study once, and record the trial's end in its run dir (result.json's ``trial``)."""
    from optuna.trial import TrialState

    from ddplab import compat

    if error:
        compat.optuna_trial(w.study, trial.number).set_user_attr("error", error[:1000])
    try:
        if state == "COMPLETE":
            w.study.tell(trial.number, value)
        else:
            w.study.tell(trial.number, state=TrialState[state])
    except RuntimeError as e:  # told (stored first); a GridSampler whose grid is done calls Study.stop, which
        if "Study.stop" not in str(e):  # only works inside Study.optimize: the limit below stops us instead
            raise
    tdir = w.dir / str(trial.number)
    result = rundir.read_result(tdir) or {"status": "failed", "error": error}
    result["trial"] = {"study": w.study.study_name, "number": trial.number, "state": state, "value": value,
                       "params": trial.params}
    rundir.write_result(tdir, result)


def where(cfg: DictConfig) -> tuple[Path, str]:
    """The study's dir (absolute) and its storage URL, as every worker and rank computes them."""
    from ddplab.study.storage import default_url

    study_dir = Path(str(cfg.study.dir)).absolute()
    return study_dir, str(cfg.study.storage or default_url(study_dir))


def trial_config(cfg: DictConfig, number: int, params: dict[str, Any]) -> DictConfig:
    """The worker's config with trial ``number``'s params, as a normal run in the trial's dir that reports to
    the study. Recomposed by Hydra where it runs (a param may pick a group option: model=mlp)."""
    study_dir, url = where(cfg)
    settings = {"mode": "train", "run_dir": str(study_dir / str(number)), "resume": "auto"}
    out = _compose(params, settings) or _updated(cfg, params, settings)
    with open_dict(out):
        out.callbacks = out.get("callbacks") or {}
        out.callbacks.study = {"_target_": "ddplab.study.report.ReportToStudy", "storage": url,
                               "study_name": str(cfg.study.name), "trial": number, "objective": out.objective,
                               "pruner": OmegaConf.to_container(out.study.pruner) if out.study.pruner else None,
                               "timeout_s": out.study.timeout_s}
    return out


def _compose(params: dict[str, Any], settings: dict[str, Any]) -> DictConfig | None:
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    if not (GlobalHydra.instance().is_initialized() and HydraConfig.initialized()):
        return None
    from hydra import compose

    hc = HydraConfig.get()
    ours = {**{k: _override_value(v) for k, v in params.items()}, **{k: str(v) for k, v in settings.items()}}
    given = [o for o in hc.overrides.task if o.lstrip("+~").split("=", 1)[0] not in ours]
    return compose(config_name=hc.job.config_name, overrides=given + [f"{k}={v}" for k, v in ours.items()])


def _override_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return repr(v) if isinstance(v, float) else str(v)


def _updated(cfg: DictConfig, params: dict[str, Any], settings: dict[str, Any]) -> DictConfig:
    """Without Hydra (ddplab.study called from Python): set the values in a copy; a group option cannot be."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        for k, v in {**params, **settings}.items():
            if isinstance(OmegaConf.select(out, k), DictConfig):
                raise ConfigError(f"study.params.{k}: choosing a group option needs train.py (Hydra composes it). "
                                  "Fix: run the study through train.py mode=study")
            OmegaConf.update(out, k, v, merge=False)
    return out


def objective_value(metrics: dict[str, Any], objective: str) -> float | None:
    v = metrics.get(objective)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
