"""What ``mode`` runs: the one table that decides it. train.py (``ddplab.cli``) and ``ddplab.run(cfg)`` both
look here; nothing below it asks for the mode again (a job is told whether it evaluates).

    mode            runs                                   ddplab.run(cfg)
    train           ddplab.job.train: ranks, Session,      yes
                    build_state, Trainer.fit
    eval            ddplab.job.evaluate: the checkpoint's   yes
                    config, Trainer.evaluate_checkpoint
    verify_resume   ddplab.verify.verify_resume: two runs   no: train.py (fresh processes of its own)
                    and their comparison
    study           ddplab.study.run_study: a worker that   no: train.py (its trials are jobs)
                    trains trials as jobs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from omegaconf import DictConfig

from ddplab import job, verify
from ddplab.config import ConfigError, validate
from ddplab.config.typed import typed


def _study(cfg: DictConfig) -> dict[str, float]:
    from ddplab.study import run_study  # Optuna's import only where a study runs

    return run_study(cfg)


@dataclass(frozen=True)
class ModeEntry:
    # what runs it; returns the metrics (the objective among them)
    entry: Callable[[DictConfig], dict[str, float]]
    in_process: bool  # ddplab.run(cfg) runs it; False: only train.py does (it starts processes of its own)
    runner: str  # where a user calls it from Python


MODES: dict[str, ModeEntry] = {
    "train": ModeEntry(job.train, True, "ddplab.run"),
    "eval": ModeEntry(job.evaluate, True, "ddplab.run"),
    "verify_resume": ModeEntry(verify.verify_resume, False, "ddplab.verify.verify_resume"),
    "study": ModeEntry(_study, False, "ddplab.study.run_study"),
}


def entry(cfg: DictConfig) -> Callable[[DictConfig], dict[str, float]]:
    """What train.py runs for ``cfg.mode`` (the schema allows only the table's modes)."""
    return MODES[str(cfg.mode)].entry


def run(cfg: DictConfig) -> dict[str, float]:
    """``ddplab.run(cfg)``: the job ``cfg`` describes (mode=train or eval); its final metrics, the same dict
    on every rank. Rank 0 also leaves ``result.json`` in the run dir (status, metrics or the error). A config
    made from plain data is put on the schema first (its defaults, its types)."""
    cfg = typed(cfg, "ddplab.run(cfg)")
    validate(cfg)  # bad values fail here, before any process group exists
    mode = str(cfg.mode)
    if not MODES[mode].in_process:  # each runs jobs of its own, in processes of their own
        raise ConfigError(
            f"mode={mode} is run by train.py (or {MODES[mode].runner}(cfg)), not by ddplab.run. "
            f"Fix: python train.py mode={mode} ..."
        )
    return MODES[mode].entry(cfg)
