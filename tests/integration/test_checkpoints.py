"""Checkpoints within a run: an in-process crash resumes bitwise with every step logged once, rotation keeps
the last k and best, a writer killed mid-write or a corrupt last.pt falls back to the previous one, NaN losses
and fp16 skips, another model's checkpoint, and bad input (issue: nothing lost, nothing hangs)."""

import math
import subprocess
import sys

import pytest
import torch
from helpers.checkpoints import FAULTY, final_state, steps_of
from helpers.compare import assert_same_checkpoint
from helpers.jobs import compose_cfg, job_env, python_train, read_scalars

import ddplab


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    ddplab.run(compose_cfg(FAULTY + ["+model.fault_call=1000000"], run_dir=d))
    return d


# Checkpoints every 5 steps and at each epoch end (22 steps/epoch): each crash resumes from another one.
@pytest.mark.parametrize(
    "kill_at,resumed",
    [
        (8, "0 epoch(s), 5 step(s)"),  # mid-epoch 1
        # first step after the epoch edge
        (23, "1 epoch(s), 22 step(s)"),
        (38, "1 epoch(s), 35 step(s)"),
    ],
)  # mid-epoch 2
@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
@pytest.mark.xdist_group("checkpoints_uninterrupted")  # the three cases on one worker: `uninterrupted` once
def test_in_process_crash_and_resume_is_bitwise_equal(tmp_path, uninterrupted, kill_at, resumed, caplog):
    args = FAULTY + [f"+model.fault_call={kill_at}", "+model.fault_rank=0"]
    with pytest.raises(RuntimeError, match="injected crash"):
        ddplab.run(compose_cfg(args, run_dir=tmp_path))
    assert (tmp_path / "result.json").read_text().count('"failed"') == 1
    caplog.clear()
    with caplog.at_level("INFO", logger="ddplab"):
        out = ddplab.run(compose_cfg(args + ["resume=auto"], run_dir=tmp_path))
    assert f"{resumed} done" in caplog.text
    assert out["step"] == 44
    assert_same_checkpoint(final_state(uninterrupted), final_state(tmp_path))
    # TensorBoard: every step once, and the same steps as the uninterrupted run.
    assert steps_of(tmp_path) == steps_of(uninterrupted)
    full = dict(read_scalars(uninterrupted / "tb")["train/loss"])
    for step, v in read_scalars(tmp_path / "tb")["train/loss"]:
        assert v == full[step]


# A rank SIGKILLed under torchrun --max-restarts, restarted and resumed bitwise with each step logged once: at
# 3 ranks in tests/integration/test_resume_world_sizes.py (its 2-rank twin here checked nothing that one does
# not).


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_checkpoint_closes_the_log_interval_so_resume_loses_no_metrics(tmp_path):
    """Logs every 5 steps, checkpoints every 7: each checkpoint step logs too, so a run that crashes after
    a checkpoint and resumes has every interval's metrics once, equal to the uninterrupted run's."""
    args = [
        "model=mlp",
        "model._target_=toy.FaultyMLP",
        "num_epochs=1",
        "log_every_n_steps=5",
        "checkpoint.every_n_steps=7",
        "progress=none",
        "+model.fault_rank=0",
    ]
    ddplab.run(compose_cfg(args + ["+model.fault_call=1000000"], run_dir=tmp_path / "full"))
    assert steps_of(tmp_path / "full") == [5, 7, 10, 14, 15, 20, 21, 22]
    part = tmp_path / "part"
    with pytest.raises(RuntimeError, match="injected crash"):  # at step 12: steps 8-10 were logged, 11 not
        ddplab.run(compose_cfg(args + ["+model.fault_call=12"], run_dir=part))
    ddplab.run(compose_cfg(args + ["+model.fault_call=12", "resume=auto"], run_dir=part))  # from step 7
    full = read_scalars(tmp_path / "full" / "tb")["train/loss"]
    assert read_scalars(part / "tb")["train/loss"] == full  # same steps, same values, each once


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_checkpoint_rotation_keeps_last_k_and_best(tmp_path):
    ddplab.run(
        compose_cfg(
            [
                "model=mlp",
                "num_epochs=3",
                "checkpoint.every_n_steps=10",
                "checkpoint.keep_last=2",
                "progress=none",
            ],
            run_dir=tmp_path,
        )
    )
    ck = tmp_path / "checkpoints"
    assert sorted(p.name for p in ck.glob("step-*.pt")) == ["step-00000060.pt", "step-00000066.pt"]
    last, best = final_state(tmp_path), torch.load(ck / "best.pt", weights_only=True)
    assert last["loop"]["step"] == 66 and best["results"]["best"] == last["results"]["best"]
    assert best["results"]["last_val"]["val/acc"] == best["results"]["best"]
    # Full state is there: RNG per rank, sampler position, config.
    assert {"python", "numpy", "torch"} <= set(last["rng"]["ranks"][0]) and last["loop"]["sampler"][
        "seed"
    ] == 0
    assert "model:" in last["meta"]["config"] and last["meta"]["world_size"] == 1


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
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
    proc = subprocess.run(
        [sys.executable, "-c", script], env=job_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 9
    ck = torch.load(tmp_path / "last.pt", weights_only=True)
    assert ck["step"] == 1 and torch.equal(ck["w"], torch.ones(1000))
    assert list(tmp_path.glob(".step-00000002.pt.tmp*"))  # the half-written file never replaced anything


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
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
    assert (
        f"cannot read checkpoint {newest}" in caplog.text and "trying the previous checkpoint" in caplog.text
    )
    with pytest.raises(RuntimeError, match=f"resume: cannot read checkpoint {bad} \\(truncated or corrupt"):
        ddplab.run(compose_cfg(args + [f"resume={bad}"], run_dir=tmp_path / "explicit"))


# ------------------------------------------------------------------ bad input
@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_checkpoint_of_another_model_lists_the_keys(tmp_path):
    ddplab.run(compose_cfg(["model=mlp", "num_epochs=1", "progress=none"], run_dir=tmp_path / "a"))
    ck = tmp_path / "a" / "checkpoints" / "last.pt"
    from ddplab.config import ConfigError  # exit 2 in one line, like any config that cannot work

    with pytest.raises(ConfigError) as e:
        ddplab.run(
            compose_cfg(
                ["model=mlp", "model.hidden=[128,256]", "num_epochs=1", f"resume={ck}"],
                run_dir=tmp_path / "b",
            )
        )
    msg = str(e.value)
    assert "does not fit this model" in msg and "net.1.weight: checkpoint (256, 64) vs model (128, 64)" in msg
    assert "Fix:" in msg
    with pytest.raises(
        ConfigError,
        match=rf"^resume={ck}: does not fit.*missing: features\.0\.weight.*unexpected: net\.1\.bias",
    ):
        ddplab.run(compose_cfg(["model=convnet", "num_epochs=1", f"resume={ck}"], run_dir=tmp_path / "c"))


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_nan_loss_stops_at_that_step_or_is_skipped(tmp_path):
    args = [
        "model=mlp",
        "model._target_=toy.FaultyMLP",
        "+model.fault=nonfinite",
        "+model.fault_call=7",
        "+model.fault_rank=0",
        "num_epochs=1",
        "log_every_n_steps=5",
        "progress=none",
    ]
    from ddplab.train.metrics import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match=r"NaN/Inf at step 7 .*Fix: lower optimizer.lr"):
        ddplab.run(compose_cfg(args, run_dir=tmp_path / "stop"))
    import toy

    toy._FAULTED.clear()  # fault again in the skip run
    out = ddplab.run(compose_cfg(args + ["nonfinite_loss=skip"], run_dir=tmp_path / "skip"))
    s = read_scalars(tmp_path / "skip" / "tb")
    assert s["vitals/skipped_steps"][-1][1] == 1.0
    assert out["step"] == 21 and out["val/acc"] > 0.5  # 22 batches, one step skipped, weights intact


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_fp16_scaler_skips_are_counted_not_errors(tmp_path):
    """An Inf gradient (finite loss) at step 7: the GradScaler skips that one step and halves its scale;
    the run goes on and the skip is counted in the interval that holds it."""
    base = [
        "model=mlp",
        "num_epochs=1",
        "amp=true",
        "amp_dtype=float16",
        "log_every_n_steps=5",
        "progress=none",
    ]
    ddplab.run(compose_cfg(base, run_dir=tmp_path / "ref"))
    out = ddplab.run(
        compose_cfg(
            base
            + [
                "model._target_=toy.FaultyMLP",
                "+model.fault=infgrad",
                "+model.fault_call=7",
                "+model.fault_rank=0",
            ],
            run_dir=tmp_path / "inf",
        )
    )
    ref, s = read_scalars(tmp_path / "ref" / "tb"), read_scalars(tmp_path / "inf" / "tb")
    assert s["train/fp16_skipped_steps"] == [(5, 0.0), (10, 1.0), (15, 0.0), (20, 0.0), (22, 0.0)]
    assert [v for _, v in ref["train/fp16_skipped_steps"]] == [0.0] * 5  # no overflow of its own
    scale, ref_scale = dict(s["vitals/loss_scale"]), dict(ref["vitals/loss_scale"])
    assert scale[5] == ref_scale[5] == 65536.0 and scale[10] == ref_scale[10] / 2 == 32768.0
    assert out["step"] == 22 and math.isfinite(out["train/loss"])  # not an error: every step still counted


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requested_without_gpu(tmp_path):
    from ddplab.config import ConfigError

    with pytest.raises(ConfigError, match=r"distributed.device=cuda but torch sees no CUDA GPU.*Fix:"):
        ddplab.run(compose_cfg(["distributed.device=cuda"], run_dir=tmp_path))


@pytest.mark.slow
def test_bad_input_exits_nonzero_with_a_message(tmp_path):
    proc = python_train(["resume=/nonexistent/last.pt"], tmp_path)
    assert proc.returncode != 0
    assert "resume=/nonexistent/last.pt: no checkpoint at /nonexistent/last.pt" in proc.stdout + proc.stderr
