"""``ddplab.run(cfg)``: one training job, callable from train.py, tests and sweepers."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from omegaconf import DictConfig

from ddplab import distributed
from ddplab.config import validate

log = logging.getLogger("ddplab")


def _own_run_dir(cfg: DictConfig) -> Path:
    """Rank 0's idea of the run dir: explicit, else Hydra's output dir, else outputs/<date>/<time>."""
    if cfg.get("run_dir"):
        return Path(cfg.run_dir)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path("outputs") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")


def run(cfg: DictConfig) -> dict[str, float]:
    """Train and evaluate as ``cfg`` says; return the final metrics (same dict on every rank)."""
    validate(cfg)  # bad values fail here, before any process group exists
    state = distributed.setup(cfg.distributed)
    clean = False
    try:
        if not state.is_main:
            logging.getLogger().setLevel(logging.WARNING)  # other ranks speak only when something is wrong
        # One dir per job: rank 0's (Hydra made it); other ranks never make their own.
        run_dir = Path(distributed.broadcast_object(str(_own_run_dir(cfg).absolute()), state))
        if state.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)

        log.info("ranks: %s", distributed.rank_table(state))

        from ddplab.trainer import Trainer  # after setup: a bad config costs no model build

        trainer = None
        try:
            trainer = Trainer(cfg, state, run_dir)
            metrics = trainer.fit()
            clean = True
            return metrics
        except Exception as e:
            where = trainer.position() if trainer else "while building the job"
            log.error(distributed.describe_failure(state, e, where, str(run_dir), cfg.distributed.timeout_s))
            raise
        finally:
            del trainer  # DDP's reducer must go before its process group does
    finally:
        distributed.teardown(clean)
