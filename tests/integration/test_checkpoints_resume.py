"""Kill-and-resume and elastic restarts across processes: a self-launched job restarts after a killed rank, a
2-rank run resumes on 1 rank (mid-epoch: a warning about random streams), leftovers of dead processes are
removed, a run dir in use is refused naming its holder, and the objective must be a logged validation metric
(issue: nothing lost, nothing hangs)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import FAULTY, final_state, steps_of
from helpers.jobs import assert_ok, compose_cfg, job_dirs, python_train, ranks, read_scalars, torchrun

import ddplab

# A rank SIGKILLed under torchrun --max-restarts, restarted and resumed bitwise with each step logged once: at
# 3 ranks in tests/integration/test_resume_world_sizes.py (its 2-rank twin here checked nothing that one does
# not).


@pytest.mark.dist
def test_self_launched_job_restarts_after_a_killed_rank(tmp_path):
    proc = python_train(
        FAULTY
        + [
            "+model.fault_call=17",
            "+model.fault=kill",
            "+model.fault_rank=1",
            "distributed.nproc_per_node=2",
            "distributed.max_restarts=1",
        ],
        tmp_path,
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "15 step(s) done" in out
    run = job_dirs(tmp_path)[0]
    assert final_state(run)["loop"]["step"] == 44
    assert steps_of(run) == [5, 10, 15, 20, 22, 25, 30, 35, 40, 44]


@pytest.mark.dist
def test_mid_epoch_resume_on_another_world_size_warns_about_random_streams(tmp_path):
    args = [
        "model=mlp",
        "model._target_=toy.FaultyMLP",
        "num_epochs=1",
        "checkpoint.every_n_steps=5",
        "progress=log",
        "run_dir=run",
        "+model.fault_rank=0",
        "distributed.timeout_s=30",
    ]
    crashed = torchrun(2, args + ["+model.fault_call=8"], tmp_path)  # checkpoint at step 5, crash at 8
    assert crashed.returncode != 0 and "injected crash" in crashed.stdout + crashed.stderr
    # Switching the injected fault off changes a model key: a deliberate change, so the opt-in says so.
    proc = python_train(
        args + ["+model.fault_call=1000000", "resume=auto", "resume_apply_changes=true"], tmp_path
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "0 epoch(s), 5 step(s) done" in out
    assert "resuming mid-epoch on 1 rank(s) from a 2-rank checkpoint" in out and "draw new streams" in out
    assert final_state(tmp_path / "run")["loop"]["step"] == 22


@pytest.mark.dist
def test_resume_on_a_different_world_size(tmp_path):
    """Same global batch, same global order: a 2-rank run resumed on 1 rank continues the same training."""
    args = ["model=mlp", "model.dropout=0", "num_epochs=2", "progress=none"]
    full = tmp_path / "full"
    full.mkdir()
    assert_ok(ranks(2, args, full))
    part = tmp_path / "part"
    part.mkdir()
    assert_ok(ranks(2, args + ["stop_after_epochs=1", "run_dir=run"], part))
    assert_ok(python_train(args + ["resume=auto", "run_dir=run"], part))
    a, b = final_state(job_dirs(full)[0]), final_state(part / "run")
    diff = max(((a["model"][k] - b["model"][k]).norm() / a["model"][k].norm()).item() for k in a["model"])
    assert b["loop"]["step"] == 44 and diff <= 1e-5


def test_leftovers_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """Killed ranks leave scratch Hydra dirs, failed torchrun jobs leave restart memos: the next start removes
    those whose process is gone (a zombie, not yet reaped, is gone), and nothing of a live one."""
    import tempfile

    from ddplab import cli

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now
    # A zombie: dead, not yet reaped (a rank killed with its launcher, before init reaps it). Its pid is
    # taken.
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
        time.sleep(0.01)
    alive = os.getpid()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    private = tmp_path / f"ddplab-{os.getuid()}"
    private.mkdir(mode=0o700)
    for pid in (dead.pid, zombie.pid, alive):
        (private / f"run-abc123-{pid}").write_text("/some/run/dir")
        (tmp_path / f"ddplab-rank1-{pid}-xyz").mkdir()
    cli._remove_orphans()
    zombie.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([private.name, f"ddplab-rank1-{alive}-xyz"])
    assert [p.name for p in private.iterdir()] == [f"run-abc123-{alive}"]


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_objective_must_be_a_logged_validation_metric_and_a_loss_is_minimised(tmp_path):
    from ddplab.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"objective='val/accuracy': ClassificationTask logs no such metric\. "
        r"Fix: objective= one of val/loss, val/acc",
    ):
        ddplab.run(
            compose_cfg(["model=mlp", "num_epochs=1", "objective=val/accuracy"], run_dir=tmp_path / "bad")
        )
    out = ddplab.run(
        compose_cfg(
            ["model=mlp", "num_epochs=3", "objective=val/loss", "progress=none"], run_dir=tmp_path / "loss"
        )
    )
    losses = [v for _, v in read_scalars(tmp_path / "loss" / "tb")["val/loss"]]
    assert len(set(losses)) == 3 and losses.index(min(losses)) != 0  # the first epoch is not the best
    # lower is better for a loss (TB: float32)
    assert out["val/loss_best"] == pytest.approx(min(losses), rel=1e-6)
    best = torch.load(tmp_path / "loss" / "checkpoints" / "best.pt", weights_only=True)
    assert best["results"]["last_val"]["val/loss"] == best["results"]["best"] == out["val/loss_best"]


@pytest.mark.slow
def test_a_run_dir_in_use_is_refused_at_once_naming_its_holder(tmp_path):
    import time

    from ddplab.rundir import RunDirLock, read_result

    run = tmp_path / "run"
    run.mkdir()
    held = RunDirLock(run)  # what a running job's rank 0 holds
    assert held.acquire() is None
    args = ["model=mlp", "num_epochs=1", "progress=none", f"run_dir={run}"]
    t0 = time.perf_counter()
    proc = python_train(args, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.perf_counter() - t0 < 60
    assert f"run dir {run} is in use by pid {os.getpid()} on " in out and "Fix: give this job another" in out
    assert sorted(p.name for p in run.iterdir()) == [".ddplab.lock"]  # nothing of the holder's was touched
    held.release()
    assert_ok(python_train(args, tmp_path))
    assert read_result(run)["status"] == "completed" and not (run / ".ddplab.lock").exists()
