"""What a study leaves for people: the end-of-study table (best trial, counts by state, one row per trial)
on the console and as ``summary.md``/``summary.csv`` in the study dir, and one HParams row per trial."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import shlex
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig

from ddplab import rundir, sweep
from ddplab.train.reporting import hparams_of, shown

log = logging.getLogger("ddplab")


class Opened(Protocol):
    """What the summary reads of a worker whose study is open (a ``StudyWorker``)."""

    cfg: DictConfig
    dir: Path  # study.dir, absolute
    url: str
    study: Any  # optuna.Study
    minimize: bool


@contextlib.contextmanager
def ask_lock(study_dir: Path) -> Iterator[None]:
    """Workers sharing ``study_dir`` take turns to write its summary (a dead holder's lock goes with it)."""
    fd = os.open(study_dir / ".ask.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def finish(w: Opened) -> dict[str, float]:
    """This worker is done: the study's table as it stands (workers still running trials add theirs when
    they end; the last to end writes the whole table). The best trial's objective."""
    objective = str(w.cfg.objective)
    with ask_lock(w.dir):  # one writer of the table at a time
        trials = w.study.get_trials(deepcopy=False)
        rows = sweep.summarize(w.dir, objective, w.minimize)
        markdown, csv = sweep.to_markdown(rows, objective), sweep.to_csv(rows)
        console = sweep.to_console(rows, objective, w.minimize)
        head = headline(w, trials, Counter(t.state.name for t in trials))
        try:
            (w.dir / "summary.md").write_text(head + "\n\n" + markdown + "\n")
            (w.dir / "summary.csv").write_text(csv)
            table = f"table: {shown(w.dir / 'summary.md')} (and summary.csv); "
        except OSError as e:  # the study's results are in its storage, and the console has the table
            log.error("could not write the study's summary in %s: %s", w.dir, e)
            table = ""
    log.info("%s", head)
    for line in console:
        log.info("%s", line)
    # pasted as is
    log.info("%sdashboard: optuna-dashboard %s", table, shlex.quote(w.url.removeprefix("journal:")))
    return best(w)


def headline(w: Opened, trials: list[Any], counts: Counter) -> str:
    states = ", ".join(
        f"{counts[s]} {s.lower()}" for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING") if counts[s]
    )
    head = (
        f"study {w.study.study_name}: {len(trials)} of {w.cfg.study.n_trials} trials ({states or 'none yet'})"
    )
    done = [t for t in trials if t.state.name == "COMPLETE"]
    if not done:
        return head + "; no trial completed"
    top = w.study.best_trial
    params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in top.params.items())
    return f"{head}; best: trial {top.number}, {w.cfg.objective}={top.value:.6g} ({params})"


def write_hparams(cfg: DictConfig, tdir: Any, trial: Any, outcome: str) -> None:
    """The trial's one HParams row, written when its outcome is known (the job writes none in a study:
    TensorBoard keeps a run's first row)."""
    from ddplab.writers import TensorBoardWriter

    events = rundir.events_dir(tdir)
    hp = {"trial": trial.number, "trial_state": outcome, **hparams_of(cfg, tdir, _world(cfg))}
    writer = TensorBoardWriter(str(events))
    writer.hparams(hp, f"{tdir.name}/{events.name}")
    writer.close()


def _world(cfg: DictConfig) -> int:
    """The trial's ranks: the launcher's (torchrun, srun), or those the worker self-launched."""
    from ddplab import strategy
    from ddplab.runtime import env

    return env.world_size() if env.is_launched() else strategy.ranks_started(cfg)


def best(w: Opened) -> dict[str, float]:
    try:
        return {str(w.cfg.objective): float(w.study.best_value)}
    except ValueError:  # no trial completed
        return {str(w.cfg.objective): math.nan}
