"""Shared by the study tests (tests/integration/test_study*.py, and the MLflow, failure-entry and
completion-record tests that run a study): a small study's overrides, its workers started and finished as
real processes, and what the study and the trials' run dirs record."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna

from ddplab.rundir import read_result
from helpers import jobs
from helpers.jobs import TRAIN

# Small trials: 2 epochs of 4 steps on the digits default, an MLP.
SMALL = [
    "model=mlp",
    "num_epochs=2",
    "limit_train_steps=4",
    "progress=none",
    "study.sampler.n_startup_trials=2",
]


def study_args(d: Path, n: int, *extra: str, pruner: bool = False) -> list[str]:
    return [
        "hparams_search=study",
        f"study.dir={d}",
        f"study.n_trials={n}",
        *SMALL,
        *([] if pruner else ["study.pruner=null"]),
        *extra,
    ]


def load(d: Path, name: str = "digits_lr_wd", url: str | None = None) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=url or f"sqlite:///{d / 'study.db'}")


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return jobs.start([sys.executable, str(TRAIN), *args], cwd)


def finish(p: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def trials_run(proc: subprocess.CompletedProcess) -> list[int]:
    """The trial numbers a worker started (its log says `trial N (params): dir`)."""
    import re

    return [int(m) for m in re.findall(r"trial (\d+) \(", proc.stdout + proc.stderr)]


def assert_told_as_recorded(d: Path, study: optuna.Study) -> None:
    """Each trial's run dir records the state and value the study was told, and the study's trial count."""
    for t in study.get_trials():
        res = read_result(d / str(t.number))
        assert res["trial"]["number"] == t.number and res["trial"]["state"] == t.state.name, res
        if t.state.name == "COMPLETE":
            assert t.value == res["trial"]["value"] == res["metrics"]["val/acc"]
