"""Checkpoints, kill-and-resume, elastic restarts, and bad input (issue: nothing lost, nothing hangs)."""

import os
import random
import subprocess
import sys

import pytest
import torch

import ddplab
from conftest import (REPO, _env, assert_ok, compose_cfg, job_dirs, python_train, read_scalars, run_cmd,
                      torchrun)

FAULTY = ["model=mlp", "model._target_=toy.FaultyMLP", "num_epochs=2", "checkpoint.every_n_steps=5",
          "log_every_n_steps=5", "progress=none"]  # mlp has dropout: RNG state must be restored too


@pytest.fixture(autouse=True)
def fresh_faults():
    import toy

    toy._FAULTED.clear()  # in-process runs share toy's once-per-process fault memory


def final_state(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def assert_bitwise_equal(a, b):
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i, st in a["optimizer"]["state"].items():
        assert torch.equal(st["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])
    assert a["scheduler"] == b["scheduler"] and a["step"] == b["step"]


def steps_of(run_dir, tag="train/loss"):
    return [s for s, _ in read_scalars(run_dir / "tb")[tag]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    ddplab.run(compose_cfg(FAULTY + ["+model.fault_call=1000000"], run_dir=d))
    return d


@pytest.mark.parametrize("kill_at", sorted(random.Random(0).sample(range(2, 44), 3)))
def test_in_process_crash_and_resume_is_bitwise_equal(tmp_path, uninterrupted, kill_at):
    args = FAULTY + [f"+model.fault_call={kill_at}", "+model.fault_rank=0"]
    with pytest.raises(RuntimeError, match="injected crash"):
        ddplab.run(compose_cfg(args, run_dir=tmp_path))
    assert (tmp_path / "result.json").read_text().count('"failed"') == 1
    out = ddplab.run(compose_cfg(args + ["resume=auto"], run_dir=tmp_path))
    assert out["step"] == 44
    assert_bitwise_equal(final_state(uninterrupted), final_state(tmp_path))
    # TensorBoard: every step once, and the same steps as the uninterrupted run.
    assert steps_of(tmp_path) == steps_of(uninterrupted)
    full = dict(read_scalars(uninterrupted / "tb")["train/loss"])
    for step, v in read_scalars(tmp_path / "tb")["train/loss"]:
        assert v == full[step]


@pytest.mark.dist
def test_torchrun_max_restarts_sigkill_resumes_bitwise(tmp_path):
    kill_at = random.Random(1).randrange(6, 40)  # a seeded "random" step
    full, killed = tmp_path / "full", tmp_path / "killed"
    full.mkdir(), killed.mkdir()
    assert_ok(torchrun(2, FAULTY + ["+model.fault_call=1000000"], full))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=3", str(REPO / "train.py"), *FAULTY, f"+model.fault_call={kill_at}",
           "+model.fault=kill", "+model.fault_rank=1"]
    proc = run_cmd(cmd, killed, timeout=300)
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "SIGKILL" in out or "Signals.SIGKILL" in out or "exitcode: -9" in out  # the rank really died
    assert "torchrun restart 1: continuing from the last checkpoint" in out
    dirs = job_dirs(killed)
    assert len(dirs) == 1  # the restart continued in the same run dir
    assert_bitwise_equal(final_state(job_dirs(full)[0]), final_state(dirs[0]))
    assert steps_of(dirs[0]) == steps_of(job_dirs(full)[0])  # each step exactly once


def test_checkpoint_rotation_keeps_last_k_and_best(tmp_path):
    ddplab.run(compose_cfg(["model=mlp", "num_epochs=3", "checkpoint.every_n_steps=10", "checkpoint.keep_last=2",
                            "progress=none"], run_dir=tmp_path))
    ck = tmp_path / "checkpoints"
    assert sorted(p.name for p in ck.glob("step-*.pt")) == ["step-00000060.pt", "step-00000066.pt"]
    last, best = final_state(tmp_path), torch.load(ck / "best.pt", weights_only=True)
    assert last["step"] == 66 and best["best"] == last["best"]
    assert best["last_val"]["val/acc"] == best["best"]
    # Full state is there: RNG per rank, sampler position, config.
    assert {"python", "numpy", "torch"} <= set(last["rng"][0]) and last["sampler"]["seed"] == 0
    assert "model:" in last["config"]


def test_writer_killed_mid_write_leaves_previous_checkpoint_loadable(tmp_path):
    script = f"""
import os, torch
from pathlib import Path
from ddplab import checkpoint
d = Path({str(tmp_path)!r})
checkpoint.save({{"step": 1, "w": torch.ones(1000)}}, d, 1, keep_last=2, is_best=False)
real = torch.save
def dying_save(obj, f):
    f.write(b"PK\\x03\\x04 half a checkpoint")
    f.flush()
    os._exit(9)  # killed mid-write
torch.save = dying_save
checkpoint.save({{"step": 2, "w": torch.zeros(1000)}}, d, 2, keep_last=2, is_best=False)
"""
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9
    ck = torch.load(tmp_path / "last.pt", weights_only=True)
    assert ck["step"] == 1 and torch.equal(ck["w"], torch.ones(1000))
    assert list(tmp_path.glob(".step-00000002.pt.tmp*"))  # the half-written file never replaced anything


def test_corrupt_last_checkpoint_falls_back_to_previous(tmp_path, caplog):
    args = ["model=mlp", "num_epochs=2", "checkpoint.every_n_steps=10", "progress=none"]
    ddplab.run(compose_cfg(args + ["stop_after_epochs=1"], run_dir=tmp_path))
    ck = tmp_path / "checkpoints"
    (ck / "last.pt").unlink()
    newest = sorted(ck.glob("step-*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    bad = tmp_path / "bad.pt"
    bad.write_bytes(newest.read_bytes())  # (rotation will delete `newest` once training goes on)
    out = ddplab.run(compose_cfg(args + ["resume=auto"], run_dir=tmp_path))
    assert out["step"] == 44
    assert f"cannot read checkpoint {newest}" in caplog.text and "trying the previous checkpoint" in caplog.text
    with pytest.raises(RuntimeError, match=f"resume: cannot read checkpoint {bad} \\(truncated or corrupt"):
        ddplab.run(compose_cfg(args + [f"resume={bad}"], run_dir=tmp_path / "explicit"))


# ------------------------------------------------------------------ bad input
def test_checkpoint_of_another_model_lists_the_keys(tmp_path):
    ddplab.run(compose_cfg(["model=mlp", "num_epochs=1", "progress=none"], run_dir=tmp_path / "a"))
    ck = tmp_path / "a" / "checkpoints" / "last.pt"
    with pytest.raises(RuntimeError) as e:
        ddplab.run(compose_cfg(["model=mlp", "model.hidden=[128,256]", "num_epochs=1", f"resume={ck}"],
                               run_dir=tmp_path / "b"))
    msg = str(e.value)
    assert "does not fit this model" in msg and "net.1.weight: checkpoint (256, 64) vs model (128, 64)" in msg
    assert "Fix:" in msg
    with pytest.raises(RuntimeError, match=r"missing: features\.0\.weight.*unexpected: net\.1\.bias"):
        ddplab.run(compose_cfg(["model=convnet", "num_epochs=1", f"resume={ck}"], run_dir=tmp_path / "c"))


def test_nan_loss_stops_at_that_step_or_is_skipped(tmp_path):
    args = ["model=mlp", "model._target_=toy.FaultyMLP", "+model.fault=nonfinite", "+model.fault_call=7",
            "+model.fault_rank=0", "num_epochs=1", "log_every_n_steps=5", "progress=none"]
    from ddplab.metrics import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match=r"NaN/Inf at step 7 .*Fix: lower optimizer.lr"):
        ddplab.run(compose_cfg(args, run_dir=tmp_path / "stop"))
    import toy

    toy._FAULTED.clear()  # fault again in the skip run
    out = ddplab.run(compose_cfg(args + ["nonfinite_loss=skip"], run_dir=tmp_path / "skip"))
    s = read_scalars(tmp_path / "skip" / "tb")
    assert s["train/skipped_steps"][-1][1] == 1.0
    assert out["step"] == 21 and out["val/acc"] > 0.5  # 22 batches, one step skipped, weights intact


def test_fp16_scaler_skips_are_counted_not_errors(tmp_path):
    out = ddplab.run(compose_cfg(["model=mlp", "num_epochs=1", "amp=true", "amp_dtype=float16",
                                  "log_every_n_steps=5", "progress=none"], run_dir=tmp_path))
    s = read_scalars(tmp_path / "tb")
    assert "train/fp16_skipped_steps" in s and all(v >= 0 for _, v in s["train/fp16_skipped_steps"])
    assert out["step"] == 22


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requested_without_gpu(tmp_path):
    with pytest.raises(RuntimeError, match=r"distributed.device=cuda but torch sees no CUDA GPU.*Fix:"):
        ddplab.run(compose_cfg(["distributed.device=cuda"], run_dir=tmp_path))


def test_bad_input_exits_nonzero_with_a_message(tmp_path):
    proc = python_train(["resume=/nonexistent/last.pt"], tmp_path)
    assert proc.returncode != 0
    assert "resume=/nonexistent/last.pt: no checkpoint at /nonexistent/last.pt" in proc.stdout + proc.stderr


@pytest.mark.dist
def test_self_launched_job_restarts_after_a_killed_rank(tmp_path):
    proc = python_train(FAULTY + ["+model.fault_call=17", "+model.fault=kill", "+model.fault_rank=1",
                                  "distributed.nproc_per_node=2", "distributed.max_restarts=1"], tmp_path)
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "15 step(s) done" in out
    run = job_dirs(tmp_path)[0]
    assert final_state(run)["step"] == 44
    assert steps_of(run) == [5, 10, 15, 20, 22, 25, 30, 35, 40, 44]


@pytest.mark.dist
def test_resume_on_a_different_world_size(tmp_path):
    """Same global batch, same global order: a 2-rank run resumed on 1 rank continues the same training."""
    args = ["model=mlp", "model.dropout=0", "num_epochs=2", "progress=none"]
    full = tmp_path / "full"
    full.mkdir()
    assert_ok(torchrun(2, args, full))
    part = tmp_path / "part"
    part.mkdir()
    assert_ok(torchrun(2, args + ["stop_after_epochs=1", "run_dir=run"], part))
    assert_ok(python_train(args + ["resume=auto", "run_dir=run"], part))
    a, b = final_state(job_dirs(full)[0]), final_state(part / "run")
    diff = max(((a["model"][k] - b["model"][k]).norm() / a["model"][k].norm()).item() for k in a["model"])
    assert b["step"] == 44 and diff <= 1e-5


def test_leftovers_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """Killed ranks leave scratch Hydra dirs, failed torchrun jobs leave restart memos: the next start removes
    those whose process is gone, and nothing of a live one."""
    import tempfile

    from ddplab import cli

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now
    alive = os.getpid()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for pid in (dead.pid, alive):
        (tmp_path / f"ddplab-run-abc123-{pid}").write_text("/some/run/dir")
        (tmp_path / f"ddplab-rank1-{pid}-xyz").mkdir()
    cli._remove_orphans()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"ddplab-run-abc123-{alive}",
                                                                 f"ddplab-rank1-{alive}-xyz"])
