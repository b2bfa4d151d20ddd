"""``mode=study``: this process is one worker of an Optuna study; start as many as you like, anywhere the
storage reaches. Each loops: claim a trial → train it (DDP inside: distributed.nproc_per_node) → report
the objective at every evaluation, stop when the pruner says so → tell the result once.

    python train.py hparams_search=study                                  # one worker
    python train.py hparams_search=study & python train.py hparams_search=study   # two, one machine
    torchrun --standalone --nproc_per_node=2 train.py hparams_search=study   # one worker of 2 ranks
    sbatch --array=0-3 --wrap "python train.py hparams_search=study study.storage=journal:/shared/s.log"

A trial is a normal run in ``<study.dir>/<number>/`` (checkpoints, TensorBoard events named after its
params, result.json with the trial's number and state). A preempted worker leaves its trial RUNNING with
a checkpoint; whichever worker looks next resumes it there (ddplab.study.worker says how). docs/studies.md.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from ddplab import rundir
from ddplab.config import ConfigError, validate
from ddplab.errors import ResourceError
from ddplab.runtime import env, group, signals
from ddplab.runtime.console import log_file_formatter, quiet_log_files
from ddplab.runtime.signals import Preempted
from ddplab.study import owner, space, storage
from ddplab.study.report import PRUNED
from ddplab.study.worker import Worker, count_death, next_trial, objective_value, tell, trial_config, trial_dir, where

log = logging.getLogger("ddplab")


def run_study(cfg: DictConfig) -> dict[str, float]:
    """Work on the study until it needs no more trials; the best trial's objective (``{objective: value}``).
    A storage that fails under the worker ends it with one line and exit code ``storage.STORAGE_EXIT``."""
    validate(cfg)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # ddplab says what happens to each trial, once
    try:
        signals.hold_for_life()  # a stop signal between trials (or after a job's last stop check) ends the worker
        return _work(cfg)
    except ConfigError:
        raise
    except Preempted:  # the worker acted on the stop signal it held: it is spent
        signals.end_hold_for_life(acted=True)
        raise
    except Exception as e:
        if not storage.failed(e):
            raise
        log.error("%s", e if isinstance(e, storage.StorageLost) else storage.StorageLost(where(cfg)[1], e))
        raise SystemExit(storage.STORAGE_EXIT) from None
    finally:
        signals.end_hold_for_life()


def _work(cfg: DictConfig) -> dict[str, float]:
    """Under torchrun or ``srun -n N`` the N ranks are one worker whose trials run on all of them: rank 0 opens
    the storage, claims, asks and tells; the others train the trial it picked (ranks.agree)."""
    w: Worker | None = None
    told: Callable[[], None] | None = None  # rank 0: the last trial's tell, made at the ranks' next agreement

    def open_study() -> None:
        nonlocal w
        w = setup(cfg)

    agree(cfg, open_study)
    try:
        while True:
            gone = env.launcher_gone()
            if gone is not None:  # torchrun's agent died as the last trial ended: nobody would stop these ranks
                log.warning("launcher died (pid %d): this worker takes no further trial (start it again to go on)",
                            gone)  # the last trial is told on the way out (finally)
                raise Preempted(f"launcher died (pid {gone})", -1, None)
            taken: tuple[Any, Any] | None = None

            def take() -> tuple[Any, ...] | None:
                # The tell comes first, inside the agreement: a storage lost there stops every rank alike (rank 0
                # alone telling while its peers waited for the next trial left them to be SIGTERMed by torchrun).
                nonlocal taken, told
                if told is not None:
                    told, tell_now = None, told
                    tell_now()
                if signals.held():  # preempted between trials: take none (the last one was told)
                    return ("stop", signals.held())
                taken = next_trial(w)  # type: ignore[arg-type]
                if taken is None:
                    return None
                number, params = taken[0].number, dict(taken[0].params)
                return ("trial", number, params, str(trial_dir(w, taken[0])))  # type: ignore[arg-type]

            picked = agree(cfg, take)
            if picked is None:
                break
            if picked[0] == "stop":
                log.warning("%s arrived between trials: this worker takes no further trial (start it again to go on)",
                            picked[1])
                raise Preempted(picked[1], -1, None)
            if taken is None:  # a rank other than 0: train the trial rank 0 picked, with it
                from ddplab.job import train

                train(trial_config(cfg, *picked[1:]), search_earlier_runs=False)
                continue
            told = _train_taken(w, *taken)  # type: ignore[arg-type]
    finally:
        if told is not None:  # the last trial completed: told even when the next agreement failed
            try:
                told()
            except Exception as e:  # the worker's own failure is what it reports; this is said beside it
                log.error("the last trial could not be told (%s: %s): it stays RUNNING, and the next worker "
                          "resumes it from its checkpoint", type(e).__name__, group.plain_message(e))

    from ddplab.study.summary import finish

    return finish(w) if w is not None else {}


def _train_taken(w: Worker, trial: Any, hold: Any) -> Callable[[], None]:
    """Rank 0: train the trial it claimed; what tells it (and then lets go of its claim), to be called before the
    next trial is asked. A trial that ends otherwise is told, or left for the next worker, here."""
    try:
        tell_it = run_trial(w, trial)
    except BaseException as e:
        try:
            if isinstance(e, Preempted):
                hold.left(e.step, e.signal_name)  # the next worker resumes it at once, and counts no death
            elif isinstance(e, ResourceError) and not storage.failed(e):
                hold.left(-1, "a full disk")  # as preempted: no death counted for what the machine refused
        finally:
            hold.release()
        raise

    def told() -> None:
        try:
            if tell_it is not None:
                tell_it()
        finally:
            hold.release()  # only once told: a claim let go before would let another worker take the trial over

    return told


def agree(cfg: DictConfig, decide: Callable[[], Any]) -> Any:
    """``decide()`` on rank 0 of a launched worker, its answer on every rank (a process group just for it);
    without a launcher, just ``decide()``. Rank 0's config error is every rank's, said once by rank 0."""
    if not env.is_launched():
        return decide()
    from ddplab.runtime import collectives, group

    dist = group.init(cfg.distributed)
    answer: Any = None
    failure: BaseException | None = None
    try:
        if dist.is_main:
            try:
                answer = ("ok", decide())
            except ConfigError as e:
                answer, failure = ("config", str(e)), e
            except Exception as e:
                answer, failure = ("storage" if storage.failed(e) else "error", f"{type(e).__name__}: {e}"), e
        answer = collectives.broadcast_object(answer, dist)
    finally:
        group.teardown(clean=True)
    if failure is not None:
        raise failure
    if answer[0] == "config":
        raise ConfigError(answer[1])
    if answer[0] == "storage":  # rank 0 says it (run_study), every rank ends alike
        from ddplab.runtime.launch import let_rank_zero_report

        let_rank_zero_report()
        raise SystemExit(storage.STORAGE_EXIT)
    if answer[0] == "error":
        raise RuntimeError(f"rank 0 of this study worker failed: {answer[1]}")
    return answer[1]


def trial_world_size(cfg: DictConfig) -> int:
    """The ranks a trial of this worker trains on: the launcher's (torchrun, srun), else its own ranks."""
    if env.is_launched():
        return env.world_size()
    return int(cfg.distributed.nproc_per_node) if getattr(cfg.distributed.strategy, "name", "") != "none" else 1


def setup(cfg: DictConfig) -> Worker:
    """Checks before any trial is asked: the objective, the space, sampler and pruner, the storage."""
    minimize = _check_objective(cfg)
    searched = space.parse(cfg.study.params, cfg)
    study_dir, url = where(cfg)
    study_dir.mkdir(parents=True, exist_ok=True)
    for key in ("sampler", "pruner"):  # a typo here would fail every trial: say it once, now
        _check_target(cfg, key, searched)
    with owner.claim_lock(url, cfg.study.timeout_s, study_dir):
        store = storage.open_storage(url, cfg.study.timeout_s)
        study = storage.open_study(store, url, str(cfg.study.name), "minimize" if minimize else "maximize",
                                   space.signature(searched), str(cfg.objective),
                                   storage.training(cfg, searched, trial_world_size(cfg)))
    log.info("study %s: %s, %d trials, %s %s; trials in %s", cfg.study.name, url, cfg.study.n_trials,
             "minimizing" if minimize else "maximizing", cfg.objective, study_dir)
    limit = int(cfg.study.n_trials)
    if str((cfg.study.sampler or {}).get("_target_", "")).endswith("GridSampler"):
        grid = math.prod(len(getattr(d, "choices", ())) for d in searched.values())
        limit = min(limit, grid)  # as Hydra's sweeper does: a grid point is not run twice
    return Worker(cfg=cfg, dir=study_dir, url=url, study=study, space=searched, minimize=minimize, limit=limit)


def _check_target(cfg: DictConfig, key: str, searched: dict[str, Any]) -> None:
    spec = cfg.study.get(key)
    if not spec:
        return
    from hydra.utils import instantiate

    from ddplab.study.worker import make_sampler

    try:
        make_sampler(cfg, searched, 0) if key == "sampler" else instantiate(spec)
    except ConfigError:
        raise
    except Exception as e:
        why = " ".join(str(e).split())[:300]
        raise ConfigError(f"study.{key}: cannot make it ({why}). Fix: a _target_ such as "
                          f"{'optuna.samplers.TPESampler' if key == 'sampler' else 'optuna.pruners.MedianPruner'} "
                          f"and its arguments, or study.{key}=null") from None


def _check_objective(cfg: DictConfig) -> bool:
    """The trainer's check, before any trial: an objective nothing logs would fail every trial. Minimised?"""
    from ddplab import build
    from ddplab.train.hooks import Callbacks
    from ddplab.task import check_objective

    return check_objective(str(cfg.objective), build.task(cfg), Callbacks(build.callbacks(cfg)).logged_names())


def run_trial(w: Worker, trial: Any) -> Callable[[], None] | None:
    """Train ``trial``; what tells it once (None: told already, it failed). A preemption leaves it RUNNING for a
    resume (the worker exits)."""

    tdir = trial_dir(w, trial)
    name = rundir.label({k: str(v) for k, v in trial.params.items()})
    log.info("trial %d (%s): %s", trial.number, name, tdir)
    handler = _log_to(tdir)
    try:
        cfg = trial_config(w.cfg, trial.number, trial.params, str(tdir))  # inside: a trial that cannot be composed is told
        metrics = _run_through_rank_deaths(w, trial.number, cfg)
    except Preempted:
        log.warning("trial %d stays RUNNING: it resumes from its checkpoint when a worker starts again", trial.number)
        raise
    except ConfigError as e:  # every trial would fail alike: fail this one and stop the worker
        _tell_held(w, trial, "FAIL", None, f"config error: {e}")
        raise
    except group.PeerLost:  # a rank of the trial died without a word: its death, which the next worker counts
        log.warning("trial %d stays RUNNING: a rank of it was killed; the next worker resumes it, counting a death",
                    trial.number)
        raise
    except Exception as e:
        lost = storage.failed(e)  # the trial's own report to the storage failed: so will the next trial's
        if isinstance(e, ResourceError) and not lost:  # a full disk: not the params' fault; every next trial too
            log.warning("trial %d stays RUNNING: the next worker resumes it from its checkpoint once there is room "
                        "(this worker stops)", trial.number)
            raise
        # A rank that only lost its peer carries the peer's error: the trial's cause, not the lost connection.
        cause = e.report if isinstance(e, group.PeerFailed) else f"{type(e).__name__}: {e}"
        _tell_held(w, trial, "FAIL", None, storage.innermost(e) if lost else cause)
        if lost:
            raise storage.StorageLost(w.url, e, f"trial {trial.number} told FAIL") from None
        if env.is_launched():  # ranks may have failed at different points: torchrun ends them, the study stays
            raise
        log.error("trial %d failed, the study goes on: %s: %s", trial.number, type(e).__name__, e)
        return None
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    note = str((rundir.read_result(tdir) or {}).get("note") or "")
    value = objective_value(metrics, str(cfg.objective))
    if note.startswith(PRUNED):
        outcome = "PRUNED"
    else:
        outcome = "COMPLETE" if value is not None else "FAIL"

    def tell_it() -> None:
        why = "" if outcome != "FAIL" else f"{cfg.objective} is {metrics.get(cfg.objective)}"
        _tell_held(w, trial, outcome, value, why)
        from ddplab.study.summary import write_hparams

        try:
            write_hparams(cfg, tdir, trial, outcome)
        except OSError as e:  # told already; rank 0 alone writes it, while its peers wait for the next trial
            log.error("trial %d: its HParams row could not be written (%s); the study goes on", trial.number, e)
        log.info("trial %d: %s %s=%s", trial.number, outcome, cfg.objective, "" if value is None else f"{value:.6g}")

    return tell_it


def _run_through_rank_deaths(w: Worker, number: int, cfg: DictConfig) -> dict[str, float]:
    """The trial's job; a rank of it killed (the OOM killer, a SIGKILL) is a death of the trial as its worker's
    would be — counted in the storage, and the trial resumed from its checkpoint, here, up to
    ``study.max_retries`` times — not a failure of the trial's params."""
    from ddplab.job import train
    from ddplab.runtime.launch import RankFailed

    while True:
        try:
            return train(cfg, search_earlier_runs=False)
        except RankFailed as e:
            if e.killed_by is None or not w.holds[number].still_mine():  # a lapsed hold: another worker has it
                raise
            deaths = count_death(w, number)
            if deaths > w.cfg.study.max_retries:
                raise RankFailed(f"{e} (death {deaths}, past study.max_retries={w.cfg.study.max_retries})") from None
            log.warning("trial %d: a rank was killed by %s: death %d of study.max_retries=%d, resuming it from its "
                        "checkpoint", number, e.killed_by, deaths, w.cfg.study.max_retries)


def _tell_held(w: Worker, trial: Any, outcome: str, value: float | None, error: str = "") -> None:
    """``tell``; where the storage cannot take it, the trial stays RUNNING and the line says so (the next
    worker, on a mended storage, resumes it as one whose worker died)."""
    try:
        tell(w, trial, outcome, value, error)
    except Exception as e:
        if not storage.failed(e):
            raise
        raise storage.StorageLost(w.url, e, f"trial {trial.number} stays RUNNING in the study: the storage cannot "
                                  "be written") from None


def _log_to(tdir: Path) -> logging.Handler:
    """The trial's own train.log, beside the worker's."""
    handler = logging.FileHandler(tdir / "train.log")
    handler.setFormatter(log_file_formatter())
    logging.getLogger().addHandler(handler)
    quiet_log_files()
    return handler
