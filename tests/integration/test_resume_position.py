"""Resume continues from what was consumed, not from steps x accumulation; and result.json never loses what
a run measured, whichever invocation rewrites it."""

from __future__ import annotations

import json

import pytest
import torch
import toy
from helpers.compare import assert_same_checkpoint, load
from helpers.jobs import assert_ok, compose_cfg, python_train

import ddplab

# Single process, batch 32 x 3 micro-batches: 44 micro-batches → 14 optimizer steps per epoch of digits.
# The 3rd training forward (step 1's last micro-batch) returns NaN: nonfinite_loss=skip drops step 1.
SKIP = [
    "model=mlp",
    "model._target_=toy.FaultyMLP",
    "+model.fault=nonfinite",
    "+model.fault_rank=0",
    "+model.fault_call=3",
    "nonfinite_loss=skip",
    "grad_accum_steps=3",
    "batch_size=32",
    "num_epochs=2",
    "checkpoint.every_n_steps=4",
    "checkpoint.keep_last=50",
    "log_every_n_steps=5",
    "progress=none",
]


@pytest.mark.slow
def test_resume_after_a_skipped_step_starts_at_the_next_unconsumed_batch(tmp_path):
    """A checkpoint taken after a skipped step resumes at the right batch and ends bitwise equal to the
    uninterrupted run (the old position, steps x accumulation, replayed one batch group and ran 1 step
    more)."""
    full = tmp_path / "full"
    # a fresh process: it faults once
    assert_ok(python_train(SKIP + [f"run_dir={full}"], tmp_path, timeout=180))
    mid = full / "checkpoints" / "step-00000004.pt"
    ck = load(mid)
    assert (ck["loop"]["step"], ck["loop"]["batches_in_epoch"]) == (4, 5)  # 5 batch groups made 4 steps

    toy._FAULTED.append("already")  # the resumed run must not fault again: its NaN was before the checkpoint
    threads = torch.get_num_threads()
    # The full run's process had one intra-op thread (OMP_NUM_THREADS=1): with two, a CPU with AVX-512 splits
    # the matmuls' sums differently, and bitwise equality is only promised for the same thread count.
    torch.set_num_threads(1)
    try:
        rest = ddplab.run(compose_cfg(SKIP + [f"resume={mid}"], run_dir=tmp_path / "rest"))
    finally:
        toy._FAULTED.clear()
        torch.set_num_threads(threads)
    a, b = load(full / "checkpoints" / "last.pt"), load(tmp_path / "rest" / "checkpoints" / "last.pt")
    # 2 x 14 minus the skipped one
    assert (a["loop"]["step"], b["loop"]["step"], rest["step"]) == (27, 27, 27)
    assert_same_checkpoint(a, b)


@pytest.mark.slow
def test_result_json_keeps_the_training_metrics_when_a_finished_run_is_resumed(tmp_path):
    """The same command again with resume=auto after the run finished: "already finished", and result.json
    still has train/loss and train/acc (they are in the checkpoint), with the same values."""
    run = tmp_path / "run"
    args = ["model=mlp", "num_epochs=1", "log_every_n_steps=5", "progress=none", f"run_dir={run}"]
    assert_ok(python_train(args, tmp_path))
    first = json.loads((run / "result.json").read_text())["metrics"]
    assert {"train/loss", "train/acc", "val/acc"} <= first.keys()
    proc = python_train(args + ["resume=auto"], tmp_path)
    assert_ok(proc)
    assert "already finished" in proc.stdout + proc.stderr
    again = json.loads((run / "result.json").read_text())["metrics"]
    for key in ("train/loss", "train/acc", "val/acc", "val/loss"):
        assert again.get(key) == first[key], (key, first, again)
    # A later invocation that fails (here: refused, another lr than the checkpoint's) keeps the measured
    # record.
    proc = python_train(args + ["resume=auto", "optimizer.lr=0.5"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    refused = json.loads((run / "result.json").read_text())
    assert refused["status"] == "failed" and refused["previous"]["metrics"] == again, refused


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_run_killed_before_its_first_checkpoint_reruns_with_one_tensorboard_history(tmp_path):
    """Found by scripts/soak.py (seed 271041745): killed before any checkpoint, resume=auto starts afresh in
    the same run dir; the dead attempt's logged steps must not show twice in TensorBoard."""
    from helpers.jobs import read_scalars, run_killed_after_step

    args = ["model=mlp", "num_epochs=1", "log_every_n_steps=5", "progress=none"]
    run_killed_after_step(compose_cfg(args, tmp_path), 12)  # logged steps 5 and 10; no checkpoint yet
    assert not (tmp_path / "checkpoints" / "last.pt").exists()
    ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path))
    steps = [s for s, _ in read_scalars(tmp_path / "tb")["train/loss"]]
    assert steps == [5, 10, 15, 20, 22]
