"""Stop after epoch 1, resume=auto continues at epoch 2 with the same optimizer/scheduler state."""

import pytest
import torch

import ddplab
from conftest import assert_ok, compose_cfg, job_dirs, python_train, read_scalars, torchrun

ARGS = ["model=mlp", "num_epochs=2", "log_every_n_steps=10", "progress=none"]  # mlp has dropout


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(a, b):
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert torch.equal(sa[i]["momentum_buffer"], sb[i]["momentum_buffer"])
    assert a["scheduler"] == b["scheduler"]
    assert (a["loop"]["epoch"], a["loop"]["step"]) == (b["loop"]["epoch"], b["loop"]["step"]) == (2, 44)


def test_in_process_resume_matches_uninterrupted_run(tmp_path):
    full = ddplab.run(compose_cfg(ARGS, run_dir=tmp_path / "full"))
    part = ddplab.run(compose_cfg(ARGS + ["stop_after_epochs=1"], run_dir=tmp_path / "part"))
    assert (part["epoch"], part["step"]) == (1, 22)
    mid = load(tmp_path / "part" / "checkpoints" / "last.pt")
    assert mid["scheduler"]["last_epoch"] == 22 and mid["optimizer"]["state"]  # momentum saved

    rest = ddplab.run(compose_cfg(ARGS + ["resume=auto"], run_dir=tmp_path / "part"))
    assert (rest["epoch"], rest["step"]) == (2, 44)
    assert rest["val/acc"] == full["val/acc"] and rest["train/loss"] == full["train/loss"]
    assert_same_state(load(tmp_path / "full" / "checkpoints" / "last.pt"),
                      load(tmp_path / "part" / "checkpoints" / "last.pt"))
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
    assert_same_state(load(job_dirs(full_dir)[0] / "checkpoints" / "last.pt"),
                      load(second / "checkpoints" / "last.pt"))


def test_resume_from_missing_path_is_a_clear_error(tmp_path):
    proc = python_train(ARGS + [f"resume={tmp_path}/nope.pt"], tmp_path)
    assert proc.returncode != 0
    assert f"resume={tmp_path}/nope.pt: no checkpoint at" in proc.stderr and "Fix:" in proc.stderr
