"""``mode=study``: this process is one worker of an Optuna study; start as many as you like, anywhere the
storage reaches. Each loops: claim a trial → train it (DDP inside: distributed.nproc_per_node) → report
the objective at every evaluation, stop when the pruner says so → tell the result once.

    python train.py hparams_search=study                                  # one worker
    python train.py hparams_search=study & python train.py hparams_search=study   # two, one machine
    torchrun --standalone --nproc_per_node=2 train.py hparams_search=study   # one worker of 2 ranks
    sbatch --array=0-3 --wrap "python train.py hparams_search=study study.storage=journal:/shared/s.log"

A trial is a normal run in ``<study.dir>/<number>/`` (checkpoints, TensorBoard events named after its
params, result.json with the trial's number and state). A preempted worker leaves its trial RUNNING with
a checkpoint; whichever worker looks next resumes it there (ddplab.study.worker.StudyWorker, one object
whose methods are a worker's life, says how). docs/studies.md.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from ddplab import failure
from ddplab.config import ConfigError, validate
from ddplab.errors import mark_said, was_said
from ddplab.runtime import env, signals
from ddplab.runtime.signals import Preempted
from ddplab.study import storage
from ddplab.study.trials import where
from ddplab.study.worker import StudyWorker

log = logging.getLogger("ddplab")


def run_study(cfg: DictConfig) -> dict[str, float]:
    """Work on the study until it needs no more trials; the best trial's objective (``{objective: value}``).
    A storage that fails under the worker ends it with one line and exit code ``storage.STORAGE_EXIT``."""
    validate(cfg)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # ddplab says what happens to each trial, once
    try:
        # a stop signal between trials (or after a job's last stop check) ends the worker
        signals.hold_for_life()
        return StudyWorker(cfg).run()
    except ConfigError:
        raise
    except Preempted:  # the worker acted on the stop signal it held: it is spent
        signals.end_hold_for_life(acted=True)
        raise
    except Exception as e:
        if not storage.failed(e):
            raise
        lost = e if isinstance(e, storage.StorageLost) else storage.StorageLost(where(cfg)[1], e)
        if not was_said(lost):  # in the storage's own words (its key first), once, by rank 0
            log.error("%s", lost)
            mark_said(lost)
        failure.leave(failure.of(lost, env.rank()), lost)  # exit storage.STORAGE_EXIT, not a sweep's NaN
    finally:
        signals.end_hold_for_life()


def setup(cfg: DictConfig) -> StudyWorker:
    """A worker with its study open: the checks a worker makes before it asks any trial (StudyWorker.open)."""
    worker = StudyWorker(cfg)
    worker.open()
    return worker
