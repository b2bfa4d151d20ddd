"""One worker of a study: claim a trial (a RUNNING one whose worker let go or died, else a new one asked of
the sampler), train it as a normal ddplab run in its run dir (``<study.dir>/<number>/`` of the worker that
asked it, recorded in the study), tell its result once, repeat.

Who holds a trial lives in the storage, not in a directory (ddplab.study.owner): workers given different
``study.dir``s share nothing else. A trial is taken over only when its owner was preempted (the record says
where; no death) or is provably gone (its process is dead on this machine, or its lease ran out), and then
resumed in its own run dir from its last checkpoint (resume=auto), and told once. A takeover of a trial
whose worker died counts a death; past ``study.max_retries`` the trial is told FAIL. Optuna's own heartbeat
is not used: it would fail a preempted trial that is about to resume. Asking and claiming happen under the
storage's lock (owner.claim_lock), so ``study.n_trials`` is exact however many workers start at once.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf, open_dict

from ddplab import rundir
from ddplab.config.errors import ConfigError
from ddplab.study import owner

log = logging.getLogger("ddplab")

DEATHS = "ddplab:deaths"  # trial user attr: how often its worker died before recording anything
TRIAL_FILE = "trial.json"  # in the trial's run dir: study, number, params (rundir.swept reads it)


@dataclass
class Worker:
    cfg: DictConfig
    dir: Path  # study.dir, absolute
    url: str
    study: Any  # optuna.Study
    space: dict[str, Any]
    minimize: bool
    limit: int  # trials to ask for: study.n_trials, at most a GridSampler's grid
    holds: dict[int, owner.Hold] = field(default_factory=dict)  # trials this worker holds, until told
    unreachable: set[int] = field(default_factory=set)  # trials whose run dir it cannot see (said once)


@contextlib.contextmanager
def ask_lock(study_dir: Path) -> Iterator[None]:
    """Workers sharing ``study_dir`` take turns to write its summary (a dead holder's lock goes with it)."""
    fd = os.open(study_dir / ".ask.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def next_trial(w: Worker) -> tuple[Any, owner.Hold] | None:
    """The trial this worker takes next (held until told), or None when the study needs no more."""
    from optuna.trial import TrialState

    from ddplab import compat

    with owner.claim_lock(w.url, w.cfg.study.timeout_s, w.dir):
        trials = w.study.get_trials(deepcopy=False)
        for t in trials:
            if t.state == TrialState.RUNNING:
                hold = _take_over(w, t)
                if hold is not None:
                    return t, hold
        if len(trials) >= w.limit:
            return None
        w.study.sampler = make_sampler(w.cfg, w.space, len(trials))
        trial = w.study.ask(w.space)
        tdir = w.dir / str(trial.number)
        tdir.mkdir(parents=True, exist_ok=True)
        # trial.json first: a dir recorded in the storage must be one a resumer can recognise (owner.reachable),
        # even if this worker dies right after recording it.
        (tdir / TRIAL_FILE).write_text(json.dumps({"study": w.study.study_name, "number": trial.number,
                                                  "params": trial.params}, indent=2))
        trial.set_user_attr(owner.DIR, str(tdir))
        w.holds[trial.number] = owner.Hold(compat.optuna_trial(w.study, trial.number)).start()
        return w.study.get_trials(deepcopy=False)[trial.number], w.holds[trial.number]


def trial_dir(w: Worker, trial: Any) -> Path:
    """The trial's run dir, as recorded in the study when it was asked (whichever worker asked it)."""
    return Path(trial.user_attrs.get(owner.DIR) or w.dir / str(trial.number))


def count_death(w: Worker, number: int) -> int:
    """One more death of trial ``number`` (its worker, or a rank of its job, killed before it recorded a
    result), read and written in the storage, where every worker counts them; the count now."""
    from ddplab import compat

    live = compat.optuna_trial(w.study, number)
    deaths = int(compat.frozen_trial(live).user_attrs.get(DEATHS, 0)) + 1
    live.set_user_attr(DEATHS, deaths)
    return deaths


def _take_over(w: Worker, trial: Any) -> owner.Hold | None:
    """Hold a RUNNING trial whose worker let go or is gone (counting a death, failing it past
    ``study.max_retries``); None while its worker is alive, or where its run dir cannot be reached."""
    from ddplab import compat

    v = owner.verdict(trial.user_attrs.get(owner.OWNER), time.time())
    if not v.free:
        return None
    tdir = trial_dir(w, trial)
    if not owner.reachable(tdir, w.study.study_name, trial.number):
        if trial.number not in w.unreachable:
            w.unreachable.add(trial.number)
            log.warning("trial %d: %s, but this worker cannot reach its run dir %s, so it leaves the trial to a "
                        "worker that can. Fix: give every worker a study.dir on a file system they all see",
                        trial.number, v.why, tdir)
        return None
    why = v.why
    if v.death:
        why += f" {owner.progress(tdir)}"
        deaths = count_death(w, trial.number)
        if deaths > w.cfg.study.max_retries:
            error = (f"its worker died {deaths} times without recording a result (study.max_retries="
                     f"{w.cfg.study.max_retries}); the last time: {why}")
            log.error("trial %d: failed: %s", trial.number, error)
            tell(w, trial, "FAIL", None, error)
            return None
        why += f"; death {deaths} of study.max_retries={w.cfg.study.max_retries}"
    w.holds[trial.number] = owner.Hold(compat.optuna_trial(w.study, trial.number)).start()
    log.info("trial %d: resuming it in %s (%s)", trial.number, tdir, why)
    return w.holds[trial.number]


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


def tell(w: Worker, trial: Any, outcome: str, value: float | None, error: str = "") -> None:
    """Tell the study once how the trial ended (``outcome``: COMPLETE, PRUNED or FAIL), and record it in its run
    dir (result.json's ``trial``)."""
    from optuna.trial import TrialState

    from ddplab import compat

    hold = w.holds.pop(trial.number, None)
    if hold is not None:
        hold.release()
        if not hold.still_mine():  # its lease ran out while this worker was away: the new holder tells it
            log.error("trial %d: another worker took it over while this one worked on it (this worker's hold "
                      "lapsed: no beat for %.0fs); it is not told %s here", trial.number, owner.LEASE_S, outcome)
            return
    if error:
        compat.optuna_trial(w.study, trial.number).set_user_attr("error", error[:1000])
    try:
        if outcome == "COMPLETE":
            w.study.tell(trial.number, value)
        else:
            w.study.tell(trial.number, state=TrialState[outcome])
    except RuntimeError as e:  # told (stored first); a GridSampler whose grid is done calls Study.stop, which
        if "Study.stop" not in str(e):  # only works inside Study.optimize: the limit below stops us instead
            raise
    tdir = trial_dir(w, trial)
    result = rundir.read_result(tdir) or {"status": "failed", "error": error}
    result["trial"] = {"study": w.study.study_name, "number": trial.number, "state": outcome, "value": value,
                       "params": trial.params}
    rundir.write_result(tdir, result)


def where(cfg: DictConfig) -> tuple[Path, str]:
    """The study's dir (absolute) and its storage URL, as every worker and rank computes them."""
    from ddplab.study.storage import default_url

    study_dir = Path(str(cfg.study.dir)).absolute()
    return study_dir, str(cfg.study.storage or default_url(study_dir))


def trial_config(cfg: DictConfig, number: int, params: dict[str, Any], tdir: str) -> DictConfig:
    """The worker's config with trial ``number``'s params, as a normal run in the trial's dir ``tdir`` that
    reports to the study. Recomposed by Hydra where it runs (a param may pick a group option: model=mlp)."""
    url = where(cfg)[1]
    settings = {"mode": "train", "run_dir": str(tdir), "resume": "auto"}
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
                raise ConfigError(f"study.params.{k}: choosing a group option needs train.py (Hydra composes it). "
                                  "Fix: run the study through train.py mode=study")
            OmegaConf.update(out, k, v, merge=False)
    return out


def objective_value(metrics: dict[str, Any], objective: str) -> float | None:
    v = metrics.get(objective)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
