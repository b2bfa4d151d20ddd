"""One job — ``mode=train`` (:func:`train`) or ``mode=eval`` (:func:`evaluate`) — callable from train.py,
tests, sweepers, studies (``ddplab.modes`` decides which runs):

    validate → strategy refusals → (self-launch N ranks) → Session → build_state → Trainer → result.json
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ddplab import failure, rundir, strategy
from ddplab.config import ConfigError, InputError, validate
from ddplab.config.typed import resolved_copy
from ddplab.errors import RecordWriteError, ResourceError, mark_said
from ddplab.runtime import env, group, signals
from ddplab.runtime.console import job_tag
from ddplab.runtime.signals import Preempted
from ddplab.session import Session
from ddplab.train.resuming import eval_config

log = logging.getLogger("ddplab")


def train(cfg: DictConfig, search_earlier_runs: bool | None = None) -> dict[str, float]:
    """mode=train: train and evaluate as ``cfg`` says; the final metrics (the same dict on every rank).

    Rank 0 also leaves ``result.json`` in the run dir — status, metrics or the error — which sweep summaries
    and ``resume=auto`` read. ``search_earlier_runs``: whether ``resume=auto`` may continue an earlier run
    of the same command (None: only when Hydra made up this run's dir)."""
    return _job(cfg, search_earlier_runs, evaluating=False)


def evaluate(cfg: DictConfig, search_earlier_runs: bool | None = None) -> dict[str, float]:
    """mode=eval: the exact evaluation of the checkpoint ``resume`` names, with that checkpoint's own config
    and this command's launch settings."""
    validate(cfg)
    return _job(eval_config(cfg), search_earlier_runs, evaluating=True)


def _job(cfg: DictConfig, search_earlier_runs: bool | None, evaluating: bool) -> dict[str, float]:
    """validate → strategy refusals → (self-launch N ranks) → Session → build_state → Trainer."""
    validate(cfg)  # bad values fail here, before any process group exists
    strategy.check_launch(cfg, env.world_size())
    problem = group.refusal(cfg.distributed)  # nccl without CUDA: before any group forms, on every launcher
    if problem:
        raise ConfigError(problem)
    nproc = cfg.distributed.nproc_per_node
    if nproc > 1:
        if not env.is_launched():
            _check_room(cfg)
            return _self_launch(cfg, evaluating)
        if not env.is_self_launched():
            log.warning(
                "distributed.nproc_per_node=%d ignored: this process is already one rank of a "
                "launched job (torchrun/SLURM)",
                nproc,
            )
    with Session(cfg, search_earlier_runs) as session:
        metrics, note, objective = _in_session(session, evaluating)
        session.complete(metrics, note, objective)
    return metrics


def _in_session(
    session: Session, evaluating: bool
) -> tuple[dict[str, float], str | None, dict[str, Any] | None]:
    """The metrics, how the run ended besides them (early stopping's note) and the objective with its
    direction (for sweep summaries; none for an evaluation)."""
    # A function of its own: if it raises, its frame (holding the trainer and
    # DDP's reducer) is in the traceback, which the Session clears before teardown.
    from ddplab.train.assemble import build_state  # after setup: a bad config costs no model build
    from ddplab.train.loop import Trainer

    state = build_state(
        session.cfg,
        session.dist,
        session.run_dir,
        evaluating=evaluating,
        search_earlier_runs=session.search_earlier_runs,
        stop=session.stop,
        provenance=session.provenance,
    )
    session.report_failures_at(state.position)
    trainer = Trainer(state)
    if evaluating:
        return trainer.evaluate_checkpoint(), None, None
    return trainer.fit(), state.stop_reason, {"name": state.cfg.objective, "minimize": state.results.minimize}


def _check_room(cfg: DictConfig) -> None:
    """More local ranks than devices never reach a step (64 ranks on 2 cores start and stall), unless the
    user lets CPU ranks share cores."""
    import torch

    nproc, d = cfg.distributed.nproc_per_node, cfg.distributed
    on_gpu = str(d.device) == "cuda" or (str(d.device) == "auto" and torch.cuda.is_available())
    have, what = (torch.cuda.device_count(), "CUDA devices") if on_gpu else (env.usable_cores(), "CPU cores")
    if nproc > have and (on_gpu or not d.oversubscribe_cpu):
        share = (
            ""
            if on_gpu
            else ", or let the ranks share the cores (slower): distributed.oversubscribe_cpu=true"
        )
        raise ConfigError(
            f"distributed.nproc_per_node={nproc}: this machine has {have} {what} for them. Fix: pass "
            f"distributed.nproc_per_node={max(have, 1)} (or fewer), or launch across nodes (torchrun, "
            f"SLURM){share}"
        )


# What every rank imports after it starts, imported once for all of them in the server they are forked from
# (runtime.launch): the loop and rank 0's TensorBoard writer, with torch's optimizer wrappers kept from
# importing its compiler stack (train.preload); first, what the strategy's ranks import anyway.
RANK_IMPORTS = ("ddplab.train.preload",)


def _self_launch(cfg: DictConfig, evaluating: bool) -> dict[str, float]:
    from ddplab.runtime.launch import launch

    run_dir = rundir.own_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    search_earlier_runs = rundir.is_hydras_default(cfg)  # decided where Hydra's config is
    config = resolved_copy(cfg)  # here, where Hydra's resolvers (${now:}, ${hydra:}) still work; typed
    config.run_dir = str(run_dir)
    job = {
        "config": config,
        "search_earlier_runs": search_earlier_runs,
        "log_tag": job_tag(),
        "evaluating": evaluating,
    }
    started = time.time()
    try:
        return launch(
            run_rank,
            job,
            cfg.distributed.nproc_per_node,
            cfg.distributed.max_restarts,
            run_dir,
            strategy.rank_imports(cfg) + RANK_IMPORTS,
        )
    except Exception as e:
        # rank 0's record of this job (not an earlier one's)
        done = rundir.read_result(run_dir, since=started) or {}
        if isinstance(e, Preempted) and done.get("status") == "completed":
            # The signal came after the last stop check: the job finished.
            log.warning("%s arrived after the job completed: it stays completed", e.signal_name)
            # this process's own (torch's agent took it): not a rank's exit code
            if e.signal_name.startswith("SIG"):
                signals.hand_on(e.signal_name)
            return done.get("metrics", {})
        raise _as_the_jobs(e, done, run_dir) from None


def _as_the_jobs(e: Exception, done: dict[str, Any], run_dir: Path) -> Exception:
    """The self-launched ranks' failure ``e`` (``runtime.launch``: their exit codes) as the job's own, for the
    entry to end with (``ddplab.failure``), with rank 0's record ``done`` as its words: marked said where a
    rank said it. Writes result.json where no rank recorded how the job ended."""
    out, said = _ranks_ending(e, done, run_dir)
    return mark_said(out) if said else out


def _ranks_ending(e: Exception, done: dict[str, Any], run_dir: Path) -> tuple[Exception, bool]:
    """The job's exception for the ranks' ``e``, and whether a rank said it already."""
    from ddplab.runtime.launch import RankRefusedConfig, RankSaid

    noted = done.get("error")
    if isinstance(e, RankRefusedConfig):  # found while building (a callback's value): rank 0 recorded it
        noted = noted or "config error: a rank refused the config (see its log)"
        if not noted.startswith("config error: "):  # an input file, said by the rank that met it
            return InputError(noted), True
        return ConfigError(noted.removeprefix("config error: ")), False  # the caller says it, once
    if isinstance(e, RankSaid):  # a full disk, said by the rank that met it: the caller decides (a study)
        if noted is None:  # rank 0 could not record how the job ended: nothing may record it in its place
            where = run_dir / rundir.RESULT
            return RecordWriteError(
                f"a rank failed and {where} could not be written (see the ranks' lines above)"
            ), True
        return ResourceError(noted), True
    stopped = done.get("status") == "preempted"
    if isinstance(e, Preempted):  # rank 0 recorded where it stopped (and said so): its result.json stays
        return Preempted(
            done.get("signal", e.signal_name), done.get("step", e.step), done.get("checkpoint")
        ), stopped
    if stopped and done.get("checkpoint"):
        # Rank 0 records a stop only after every rank's part of its checkpoint is in: a rank that died
        # afterwards (seen: SIGABRT as its interpreter exited) loses nothing. The job stays preempted.
        log.warning(
            "%s, after every rank checkpointed at step %s: the job stays preempted", e, done.get("step")
        )
        return Preempted(done.get("signal", "SIGTERM"), done.get("step", -1), done["checkpoint"]), True
    record = failure.of(e).record
    if done.get("status") != "failed" and record:  # rank 0's record of the first real error stays
        rundir.write_result(run_dir, record)
    return e, False


def run_rank(job: dict[str, Any]) -> dict[str, float]:
    """One self-launched rank: the parent's resolved, typed config → its job (train or evaluate). A failure
    the rank said ends it with the exit code its parent reads (``ddplab.failure``); a crash and a stop
    propagate (torch's agent records the traceback; ``runtime.launch`` exits 128 + the signal)."""
    try:
        return _job(job["config"], job["search_earlier_runs"], job["evaluating"])
    except Exception as e:
        ended = failure.of(e, env.rank(), in_rank=True)
        if ended.kind in ("crash", "preempted"):
            raise
        failure.leave(ended, e)
