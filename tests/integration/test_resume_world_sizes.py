"""Bitwise resume where a sum of the ranks' gradients has an order: 3 and 4 DDP ranks (issue 45).

With two ranks a + b = b + a, so a resumed process that adds the ranks' gradients in another order than the
one it replaces still gets the same bits; with three it does not. DDP re-buckets its gradients after its
first backward, and where a gradient sits in a bucket decides the order gloo's (and NCCL's) all-reduce adds
it in: a restarted process reduced its first step in the one-bucket layout the original used only at step 1
(weights off by ~3e-8). ddplab fixes the final layout before step 1 in every process
(``ddplab.compat.settle_ddp_buckets``). Each case here failed before that: a transformer (task=lm, TinyGPT
with dropout) with gradient accumulation, stopped by SIGKILL (torchrun restarts the ranks) or by SIGTERM
(inside a step evaluation, or between steps) and resumed, ends bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import tokens
from helpers.compare import assert_same_checkpoint, load, load_whole
from helpers.jobs import REPO, assert_ok, ranks, read_scalars, run_cmd, torchrun

# one worker builds `reference` once
pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("resume_world_sizes")]

# 36 global samples of 16 tokens a step: 3 ranks x 3 micro-batches of 4, or 4 ranks x 3 of 3. A checkpoint
# every 10 steps, an evaluation every 20 (one batch a rank: 327 windows).
LM = [
    "task=lm",
    "dataset=tokens",
    "dataset.block_size=16",
    "model.n_embd=32",
    "model.n_layer=2",
    "model.n_head=2",
    "model.dropout=0.1",
    "batch_size=36",
    "grad_accum_steps=3",
    "num_epochs=null",
    "max_steps=50",
    "eval_every_n_steps=20",
    "checkpoint.every_n_steps=10",
    "log_every_n_steps=5",
    "progress=none",
    "model._target_=soak_toy.SoakGPT",
    "+callbacks.soak._target_=soak_toy.SoakCallback",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    return tokens.corpus(tmp_path_factory.mktemp("corpus") / "data", 0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> dict[int, Path]:
    """The uninterrupted runs at 3 and 4 ranks, shared by every case: self-launched (each case's torchrun
    then also shows the two launchers train bitwise alike)."""
    runs = {}
    for name, n, extra in ((3, 3, []), (4, 4, []), ("fsdp", 3, ["distributed=fsdp"])):
        run = tmp_path_factory.mktemp(f"ref{name}") / "run"
        assert_ok(ranks(n, LM + extra + corpus + [f"hydra.run.dir={run}"], run.parent))
        assert load(run / "checkpoints" / "last.pt")["loop"]["step"] == 50
        runs[name] = run
    return runs


def fault_env(tmp_path: Path, **fault) -> dict[str, str]:
    """The one fault soak_toy's model and callback send (the processes after it run at full speed)."""
    (tmp_path / "fault").mkdir()
    fault.setdefault("dir", str(tmp_path / "fault"))
    return {"SOAK_FAULT": json.dumps(fault), "SOAK_TRIAL_ID": str(tmp_path)}


def fired(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "fault" / "fired").read_text())


def test_three_ranks_a_rank_sigkilled_and_restarted_by_torchrun_ends_bitwise(tmp_path, corpus, reference):
    """Rank 1 dies in the forward of step 25's first micro-batch; torchrun restarts all three from step 20's
    checkpoint."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=3",
        "--max-restarts=1",
        str(REPO / "train.py"),
        *LM,
        *corpus,
        f"hydra.run.dir={run}",
    ]
    env = fault_env(tmp_path, phase="forward", k=24 * 3 + 1, rank=1, target="self", signal="SIGKILL")
    assert_ok(run_cmd(cmd, tmp_path, extra_env=env))
    log = (run / "train.log").read_text()
    assert fired(tmp_path)["step"] == 24 and "torchrun restart 1: continuing from the last checkpoint" in log
    assert_same_checkpoint(reference[3] / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
    # One TensorBoard history across the restart: each step logged once, with the uninterrupted run's values
    # (this case replaces the 2-rank tests/integration/test_checkpoints.py one that checked the same).
    assert read_scalars(run)["train/loss"] == read_scalars(reference[3])["train/loss"]


def test_three_ranks_sigterm_inside_a_step_evaluation_then_resume_auto_ends_bitwise(
    tmp_path, corpus, reference
):
    """SIGTERM to rank 0 halfway through step 40's evaluation, mid-epoch (each evaluation's one batch takes 3
    s here, so the ranks' ~1 s stop check falls inside): every rank stops there with the evaluation pending;
    resume=auto evaluates step 40 first and trains on."""
    run = tmp_path / "run"
    env = {
        **fault_env(tmp_path, phase="evaluation", k=2, rank=0, target="self", signal="SIGTERM"),
        "SOAK_EVAL_DELAY_S": "3",
    }
    proc = torchrun(3, LM + corpus + [f"hydra.run.dir={run}"], tmp_path, extra_env=env)
    result = json.loads((run / "result.json").read_text())
    assert proc.returncode != 0 and (result["status"], result["step"]) == ("preempted", 40), result
    assert load(run / "checkpoints" / "last.pt")["loop"]["eval_pending"]
    assert [s for s, _ in read_scalars(run)["val/loss"]] == [20]  # step 40's, cut short, not logged
    assert_ok(torchrun(3, LM + corpus + [f"hydra.run.dir={run}", "resume=auto"], tmp_path))
    assert_same_checkpoint(reference[3] / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
    # step 40's evaluation once, equal to the uninterrupted one's (this case replaces the 2-rank one that
    # tests/integration/test_steps.py ran at its step 300)
    assert read_scalars(run)["val/loss"] == read_scalars(reference[3])["val/loss"]


def test_four_ranks_sigterm_between_steps_then_resume_auto_ends_bitwise(tmp_path, corpus, reference):
    """SIGTERM to the launcher (torchrun passes it to every rank) in step 13's backward: the ranks agree on a
    step, checkpoint it and stop; resume=auto continues there, mid-interval (steps 13-15 are not a log
    step)."""
    run = tmp_path / "run"
    env = fault_env(tmp_path, phase="backward", k=12 * 3 + 2, rank=2, target="launcher", signal="SIGTERM")
    proc = torchrun(4, LM + corpus + [f"hydra.run.dir={run}"], tmp_path, extra_env=env)
    result = json.loads((run / "result.json").read_text())
    assert proc.returncode != 0 and result["status"] == "preempted" and 13 <= result["step"] < 20, result
    assert_ok(torchrun(4, LM + corpus + [f"hydra.run.dir={run}", "resume=auto"], tmp_path))
    assert_same_checkpoint(reference[4] / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")


def test_fsdp_at_three_ranks_a_rank_sigkilled_and_restarted_by_torchrun_ends_bitwise(
    tmp_path, corpus, reference
):
    """FSDP reduce-scatters into fixed shards (no re-bucketing): bitwise before the DDP fix too, kept so at 3
    ranks; its checkpoints are compared whole (read back from the shards)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=3",
        "--max-restarts=1",
        str(REPO / "train.py"),
        *LM,
        "distributed=fsdp",
        *corpus,
        f"hydra.run.dir={run}",
    ]
    env = fault_env(tmp_path, phase="backward", k=31 * 3 + 3, rank=2, target="self", signal="SIGKILL")
    assert_ok(run_cmd(cmd, tmp_path, extra_env=env))
    assert fired(tmp_path)["step"] == 31 and "torchrun restart 1" in (run / "train.log").read_text()
    assert_same_checkpoint(
        load_whole(reference["fsdp"] / "checkpoints" / "last.pt"), load_whole(run / "checkpoints" / "last.pt")
    )
