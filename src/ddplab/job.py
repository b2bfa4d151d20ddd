"""``ddplab.run(cfg)`` (defined here, in ddplab.job): one training job, callable from train.py, tests and sweepers."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from omegaconf import DictConfig, open_dict

from ddplab import checkpoint, distributed
from ddplab.config import ConfigError, validate

log = logging.getLogger("ddplab")


def _own_run_dir(cfg: DictConfig) -> Path:
    """This process's idea of the run dir: explicit, else Hydra's output dir, else outputs/<date>/<time>."""
    if cfg.get("run_dir"):
        return Path(cfg.run_dir).absolute()
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir).absolute()
    return (Path("outputs") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")).absolute()


def run(cfg: DictConfig) -> dict[str, float]:
    """Train and evaluate as ``cfg`` says; return the final metrics (same dict on every rank).

    Rank 0 also leaves ``result.json`` in the run dir — status, metrics or the
    error — which sweep summaries and ``resume=auto`` read.
    """
    validate(cfg)  # bad values fail here, before any process group exists
    strategy = cfg.distributed.strategy
    if strategy in ("none", "dp") and distributed.env_world_size() > 1:
        raise ConfigError(f"distributed.strategy={strategy}: runs ONE process, but this one was launched as one "
                          f"of {distributed.env_world_size()} ranks. Fix: run `python train.py distributed="
                          f"{strategy} ...` without torchrun, or use distributed=ddp (or fsdp) under torchrun")
    if cfg.distributed.nproc_per_node > 1:
        if not distributed.is_launched():
            return _self_launch(cfg)
        if not distributed.is_self_launched():
            log.warning("distributed.nproc_per_node=%d ignored: this process is already one rank of a "
                        "launched job (torchrun/SLURM)", cfg.distributed.nproc_per_node)
    state = distributed.setup(cfg.distributed)
    clean = False
    try:
        if not state.is_main:
            logging.getLogger().setLevel(logging.WARNING)  # other ranks speak only when something is wrong
        cfg = distributed.sync_config(cfg, state)  # a sweeper may have sampled per rank
        # One dir per job: rank 0's (Hydra made it); other ranks never make their own.
        run_dir = Path(distributed.broadcast_object(str(_own_run_dir(cfg)), state))
        if state.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            memo = distributed.run_dir_memo()
            if memo is not None:
                memo.write_text(str(run_dir))
        if distributed.elastic_restart_count() > 0 and not cfg.resume:
            log.info("torchrun restart %d: continuing from the last checkpoint (resume=auto)",
                        distributed.elastic_restart_count())
            with open_dict(cfg):
                cfg.resume = "auto"
        log.info("ranks: %s", distributed.rank_table(state, distributed.config_digest(cfg)))

        from ddplab.trainer import Trainer  # after setup: a bad config costs no model build

        trainer = None
        try:
            trainer = Trainer(cfg, state, run_dir)
            metrics = trainer.fit()
            clean = True
            if state.is_main:
                checkpoint.write_result(run_dir, {"status": "completed", "metrics": metrics})
                memo = distributed.run_dir_memo()
                if memo is not None:  # only a failed attempt needs it (for torchrun's restart)
                    memo.unlink(missing_ok=True)
            return metrics
        except Exception as e:
            where = trainer.position() if trainer else "while building the job"
            report = distributed.describe_failure(state, e, where, str(run_dir), cfg.distributed.timeout_s)
            log.error(report)
            if state.is_main:
                checkpoint.write_result(run_dir, {"status": "failed", "error": report})
            raise
        finally:
            del trainer  # DDP's reducer must go before its process group does
    finally:
        distributed.teardown(clean)


def _self_launch(cfg: DictConfig) -> dict[str, float]:
    from ddplab.launch import launch

    run_dir = _own_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return launch(cfg, run_dir)
    except Exception as e:
        checkpoint.write_result(run_dir, {"status": "failed", "error": str(e)})
        raise
