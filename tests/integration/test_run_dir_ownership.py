"""A run dir belongs to one job from its first byte (issue 22, item 3).

Hydra writes ``.hydra/``, ``train.log`` and a sweep's ``multirun.yaml`` before any job code runs;
these tests give two jobs the same dir — by name, by sweep dir, by Hydra's dated default — and
check that the second is refused before writing, naming the holder, or gets its own dir.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.jobs import TRAIN, assert_ok, python_train
from helpers.processes import finish, start, wait_for
from omegaconf import OmegaConf

pytestmark = pytest.mark.slow  # simultaneous launches of real processes

SMALL = ["model=mlp", "num_epochs=1", "progress=none"]
# 22 steps of 0.25 s: each job of a sweep runs several seconds, long enough to be raced.
SLOW = ["model=mlp", "model._target_=toy.SlowMLP", "+model.delay_s=0.25", "num_epochs=1", "progress=none"]


def trained_lr(run: Path) -> float:
    """The learning rate the run's checkpoint trained with (its own config, not Hydra's record)."""
    meta = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["meta"]
    return float(OmegaConf.create(meta["config"]).optimizer.lr)  # the config as YAML text


def overrides(run: Path) -> list[str]:
    return [line[2:] for line in (run / ".hydra" / "overrides.yaml").read_text().splitlines()]


def test_hydras_dated_dir_that_exists_is_never_reused(tmp_path):
    """Another job's dir under the name Hydra would pick (started the same second) stays untouched:
    this job gets ``<time>_1``."""
    day = tmp_path / "outputs" / time.strftime("%Y-%m-%d")
    now = time.time()
    theirs = []
    for s in range(90):  # every name Hydra could pick while this job starts
        d = day / time.strftime("%H-%M-%S", time.localtime(now + s))
        (d / ".hydra").mkdir(parents=True, exist_ok=True)
        (d / ".hydra" / "overrides.yaml").write_text("- the other job's overrides\n")
        theirs.append(d)
    proc = python_train([*SMALL, "optimizer.lr=0.07"], tmp_path)
    assert_ok(proc)
    for d in theirs:
        assert sorted(p.name for p in d.iterdir()) == [".hydra"], d
        assert (d / ".hydra" / "overrides.yaml").read_text() == "- the other job's overrides\n"
    mine = [d for d in day.iterdir() if d not in theirs]
    assert len(mine) == 1 and mine[0].name.endswith("_1") and mine[0].name[:-2] in {d.name for d in theirs}
    assert overrides(mine[0])[-1] == "optimizer.lr=0.07"
    assert json.loads((mine[0] / "result.json").read_text())["status"] == "completed"


def test_two_runs_started_together_get_a_dir_each(tmp_path):
    procs = [
        start([sys.executable, str(TRAIN), *SMALL, f"optimizer.lr={lr}"], tmp_path, tmp_path / f"{lr}.log")
        for lr in (0.1, 0.01)
    ]
    for p, lr in zip(procs, (0.1, 0.01)):
        finish(p, tmp_path / f"{lr}.log", timeout=240)
        assert p.returncode == 0, (tmp_path / f"{lr}.log").read_text()[-3000:]
    runs = sorted((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 2
    for run in runs:
        lr = float(overrides(run)[-1].split("=")[1])
        assert trained_lr(run) == lr
        log = (run / "train.log").read_text()
        assert log.count("ranks: ") == 1  # one job's log, not two interleaved


def test_a_second_sweep_into_a_running_sweeps_dir_is_refused_before_writing(tmp_path):
    sw = tmp_path / "sw"
    cmd = [sys.executable, str(TRAIN), "-m", *SLOW, f"hydra.sweep.dir={sw}"]
    first = start([*cmd, "optimizer.lr=0.1,0.05"], tmp_path, tmp_path / "first.log")
    wait_for(sw / "0" / ".hydra" / "overrides.yaml", first, tmp_path / "first.log")
    t0 = time.monotonic()
    second = python_train(
        ["-m", *SLOW, f"hydra.sweep.dir={sw}", "optimizer.lr=0.01,0.02"], tmp_path, timeout=120
    )
    # and a single run named into the first sweep's job dir
    third = python_train([*SMALL, f"hydra.run.dir={sw / '1'}"], tmp_path, timeout=120)
    assert time.monotonic() - t0 < 60
    still_running = first.poll() is None
    finish(first, tmp_path / "first.log", timeout=240)
    assert first.returncode == 0 and still_running, (tmp_path / "first.log").read_text()[-3000:]
    for proc, where in ((second, sw), (third, sw)):
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert lines == [lines[0]] and lines[0].startswith(
            f"error: run dir {where} is in use by pid {first.pid} on "
        )
    assert "Fix: give this job another hydra.sweep.dir" in second.stderr
    for job, lr in (("0", 0.1), ("1", 0.05)):
        assert overrides(sw / job)[-1] == f"optimizer.lr={lr}" and trained_lr(sw / job) == lr
        assert "in use" not in (sw / job / "train.log").read_text()
    assert "optimizer.lr=0.1,0.05" in (sw / "multirun.yaml").read_text()
    assert "0.01" not in (sw / "multirun.yaml").read_text()
    assert sorted(p.name for p in sw.iterdir()) == ["0", "1", "multirun.yaml", "summary.csv", "summary.md"]
