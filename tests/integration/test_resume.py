"""Stop after epoch 1, resume=auto continues at epoch 2 with the same optimizer/scheduler state."""

import pytest
from helpers.compare import assert_same_checkpoint, load
from helpers.jobs import assert_ok, compose_cfg, job_dirs, python_train, read_scalars, torchrun

import ddplab

pytestmark = pytest.mark.slow  # whole runs, stopped and resumed

ARGS = ["model=mlp", "num_epochs=2", "log_every_n_steps=10", "progress=none"]  # mlp has dropout


def assert_same_state(a, b):
    assert_same_checkpoint(a, b)
    assert (a["loop"]["epoch"], a["loop"]["step"]) == (2, 44)


def test_in_process_resume_matches_uninterrupted_run(tmp_path):
    full = ddplab.run(compose_cfg(ARGS, run_dir=tmp_path / "full"))
    part = ddplab.run(compose_cfg(ARGS + ["stop_after_epochs=1"], run_dir=tmp_path / "part"))
    assert (part["epoch"], part["step"]) == (1, 22)
    mid = load(tmp_path / "part" / "checkpoints" / "last.pt")
    assert mid["scheduler"]["last_epoch"] == 22 and mid["optimizer"]["state"]  # momentum saved

    rest = ddplab.run(compose_cfg(ARGS + ["resume=auto"], run_dir=tmp_path / "part"))
    assert (rest["epoch"], rest["step"]) == (2, 44)
    assert rest["val/acc"] == full["val/acc"] and rest["train/loss"] == full["train/loss"]
    assert_same_state(
        load(tmp_path / "full" / "checkpoints" / "last.pt"),
        load(tmp_path / "part" / "checkpoints" / "last.pt"),
    )
    # One TensorBoard history, each step once, across the two invocations.
    s = read_scalars(tmp_path / "part" / "tb")
    assert [st for st, _ in s["train/loss"]] == [10, 20, 22, 30, 40, 44]
    assert [st for st, _ in s["val/acc"]] == [22, 44]


@pytest.mark.dist
def test_torchrun_resume_auto_finds_the_earlier_run_of_the_same_command(tmp_path):
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    full_dir.mkdir(), part_dir.mkdir()
    assert_ok(torchrun(2, ARGS, full_dir))
    assert_ok(torchrun(2, ARGS + ["stop_after_epochs=1"], part_dir))
    proc = torchrun(2, ARGS + ["resume=auto"], part_dir)  # a new Hydra run dir for this invocation
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "resume=auto: continuing" in out and "1 epoch(s), 22 step(s) done" in out
    first, second = job_dirs(part_dir)
    assert f"continuing {first}" in out
    assert_same_state(
        load(job_dirs(full_dir)[0] / "checkpoints" / "last.pt"), load(second / "checkpoints" / "last.pt")
    )


def test_resume_from_missing_path_is_a_clear_error(tmp_path):
    proc = python_train(ARGS + [f"resume={tmp_path}/nope.pt"], tmp_path)
    assert proc.returncode != 0
    assert f"resume={tmp_path}/nope.pt: no checkpoint at" in proc.stderr and "Fix:" in proc.stderr


def test_resume_auto_with_a_named_run_dir_never_continues_another_run(tmp_path):
    """An older run of the same command sits next door: a run dir the user named is the only place looked
    in."""
    args = ARGS + ["stop_after_epochs=1", "resume=auto"]
    assert_ok(python_train(args + [f"hydra.run.dir={tmp_path}/X/old"], tmp_path))
    proc = python_train(args + [f"hydra.run.dir={tmp_path}/X/new"], tmp_path)
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "resumed from" not in out and "continuing" not in out
    # trained from scratch
    assert load(tmp_path / "X" / "new" / "checkpoints" / "last.pt")["loop"]["step"] == 22


@pytest.mark.dist
def test_torchrun_restart_continues_its_own_run_never_an_older_one(tmp_path):
    """Rank 1 is SIGKILLed at step 10, before this run's first checkpoint, while an older finished run of the
    same overrides exists: the restart starts this run afresh in its own dir, and finishes it."""
    import sys

    from helpers.jobs import REPO, run_cmd

    from ddplab.rundir import read_result

    args = ARGS + [
        "model._target_=toy.FaultyMLP",
        "+model.fault=kill",
        "+model.fault_rank=1",
        "+model.fault_call=10",
    ]
    assert_ok(python_train(args + [f"hydra.run.dir={tmp_path}/X/new"], tmp_path))  # one rank: never faults
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        str(REPO / "train.py"),
        *args,
        f"hydra.run.dir={tmp_path}/X/new2",
    ]
    proc = run_cmd(cmd, tmp_path, timeout=300)
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert (
        "torchrun restart 1" in out and "already finished" not in out and "resume=auto: continuing" not in out
    )
    new2 = tmp_path / "X" / "new2"
    assert load(new2 / "checkpoints" / "last.pt")["loop"]["step"] == 44
    assert read_result(new2)["status"] == "completed" and read_result(new2)["metrics"]["step"] == 44
