"""Training by steps in real runs (issue 33): ``max_steps`` beside ``num_epochs``, ``eval_every_n_steps``
(exact evaluations mid-epoch at 1-3 ranks that change no weight), best.pt and early stopping on step
evaluations, a run resumed after its end, what the console says, and length config errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.compare import assert_same_checkpoint
from helpers.jobs import assert_ok, compose_cfg, ranks, read_scalars
from helpers.steps import _corpus
from helpers.tokens import TINY_LM

import ddplab
from ddplab.config.errors import ConfigError
from ddplab.config.validate import validate
from ddplab.data.tokens import tokens

# A tiny LM on a generated token file; batch 48 x 16 tokens: 245 steps an epoch (0.2 MB; 61 for 0.05 MB, so
# 150 steps cross two epoch ends, which a step cadence does not evaluate, and every evaluation falls
# mid-epoch).
LM = TINY_LM + ["batch_size=48", "progress=log"]
STEPS = ["num_epochs=null", "max_steps=150", "eval_every_n_steps=25", "log_every_n_steps=25"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> list[str]:
    return _corpus(tmp_path_factory, 0.05)


def val_points(run: Path) -> list[tuple[int, float]]:
    return read_scalars(run)["val/loss"]


def last(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


@pytest.mark.dist
def test_150_steps_evaluated_every_25_exactly_at_world_sizes_1_2_3(tmp_path, small_corpus):
    corpus = small_corpus
    n_val = len(tokens(corpus[0].split("=", 1)[1], corpus[1].split("=", 1)[1], block_size=16).val)
    runs = {}
    for n in (1, 2, 3):
        run = tmp_path / str(n)
        assert_ok(ranks(n, LM + STEPS + corpus + [f"hydra.run.dir={run}"], tmp_path, timeout=300))
        runs[n] = run
        points = val_points(run)
        assert [s for s, _ in points] == [25, 50, 75, 100, 125, 150], (n, points)
        # the whole set, each sample once
        assert {v for _, v in read_scalars(run)["val/num_samples"]} == {n_val}
        assert json.loads((run / "result.json").read_text())["metrics"]["step"] == 150
    for n in (2, 3):
        for (s1, v1), (sn, vn) in zip(val_points(runs[1]), val_points(runs[n])):
            assert vn == pytest.approx(v1, rel=1e-5), (n, s1)  # fp32: equal to the reduction order
    log = (runs[2] / "train.log").read_text()
    spe = len(tokens(corpus[0].split("=", 1)[1], corpus[1].split("=", 1)[1], block_size=16).train) // 48
    assert spe == 61  # so 150 steps are 2.46 epochs: two epoch ends pass without an evaluation
    assert "150 steps (max_steps; 61 steps/epoch, 2.46 epochs)" in log
    assert f"step 75/150  val/num_samples={n_val}" in log and "done: 150/150 steps (2.46 epochs)" in log
    # A SIGTERM inside a step evaluation, mid-epoch, resumed bitwise with each evaluation logged once: at 3
    # ranks in tests/integration/test_resume_world_sizes.py (this test's 2-rank stop checked nothing that one
    # does not).


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_how_often_a_run_evaluates_changes_no_weight_and_best_pt_follows_step_evaluations(tmp_path, corpus):
    """Evaluations keep training's random streams where they were (dropout here): weights are bitwise the same
    whatever eval_every_n_steps; best.pt is the best step evaluation's."""
    args = LM + corpus + ["model.dropout=0.2", "num_epochs=null", "max_steps=60", "log_every_n_steps=7"]
    out = {
        n: ddplab.run(compose_cfg(args + [f"eval_every_n_steps={n}"], tmp_path / str(n))) for n in (0, 7, 20)
    }
    for n in (7, 20):
        assert_same_checkpoint(last(tmp_path / "0"), last(tmp_path / str(n)))
    assert [s for s, _ in val_points(tmp_path / "0")] == [60]  # no cadence: the run's last step only
    points = val_points(tmp_path / "20")
    assert [s for s, _ in points] == [20, 40, 60]
    best_step, best = min(points, key=lambda p: p[1])
    saved = torch.load(tmp_path / "20" / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    assert saved["loop"]["step"] == best_step and out[20]["val/loss_best"] == pytest.approx(best, rel=1e-6)


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_num_epochs_and_max_steps_whichever_ends_first_and_said(tmp_path, corpus, caplog):
    caplog.set_level("INFO", logger="ddplab")
    both = ddplab.run(
        compose_cfg(
            LM + corpus + ["num_epochs=1", "max_steps=1000", "log_every_n_steps=50"],
            tmp_path / "epochs_first",
        )
    )
    assert both["step"] == 245 and both["epoch"] == 1
    log, _ = caplog.text, caplog.clear()
    assert (
        "245 steps/epoch x 1 epochs = 245 steps (num_epochs ends before max_steps=1,000; num_epochs=null "
        "trains by steps alone)"
    ) in log
    first = ddplab.run(
        compose_cfg(
            LM + corpus + ["num_epochs=3", "max_steps=250", "log_every_n_steps=50"], tmp_path / "steps_first"
        )
    )
    assert first["step"] == 250 and first["epoch"] == 1  # one whole epoch, then 5 steps of the second
    log = caplog.text
    assert "250 steps (max_steps ends first; num_epochs=3 would be 735; 245 steps/epoch)" in log
    # epoch 1's end, and the last step
    assert [s for s, _ in val_points(tmp_path / "steps_first")] == [245, 250]
    # The progress line: the task's own metrics only (no acc for a language model), tokens/s, an ETA.
    line = next(x for x in log.splitlines() if " step 50/250 " in x)
    assert re.search(
        r"epoch 1 step 50/250  loss=\S+ perplexity=\S+  lr=\S+  [\d,]+ tokens/s  step [\d.]+ ms "
        # minutes on a loaded machine
        r"\(max [\d.]+\)  ETA (\d+h\d\dm|\d+m\d\ds|\d+s)$",
        line,
    ), line
    assert "acc=" not in log


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_run_by_steps_resumed_after_its_end_trains_nothing_and_says_so(tmp_path, corpus, caplog):
    args = LM + corpus + ["num_epochs=null", "max_steps=30"]
    ddplab.run(compose_cfg(args, tmp_path / "r"))
    caplog.set_level("INFO", logger="ddplab")
    again = ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path / "r"))
    assert again["step"] == 30
    assert "already finished: 30 of 30 steps done, nothing to train" in caplog.text


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_early_stopping_follows_step_evaluations(tmp_path, corpus, caplog):
    caplog.set_level("INFO", logger="ddplab")
    out = ddplab.run(
        compose_cfg(
            LM
            + corpus
            + [
                "num_epochs=null",
                "max_steps=600",
                "eval_every_n_steps=20",
                "callbacks=[early_stopping]",
                "callbacks.early_stopping.patience=1",
                "callbacks.early_stopping.min_delta=100",
            ],
            tmp_path / "r",
        )
    )
    assert out["step"] == 40  # the second evaluation did not improve by 100: stopped there, mid-epoch
    assert "stopped early at step 40: val/loss did not improve by more than 100.0 for 1 checks" in caplog.text
    assert last(tmp_path / "r")["loop"]["step"] == 40 and [s for s, _ in val_points(tmp_path / "r")] == [
        20,
        40,
    ]


@pytest.mark.parametrize(
    "override,match",
    [
        (
            ["num_epochs=null"],
            r"num_epochs=None: with max_steps=null too, the run would never end\. Fix: pass "
            r"num_epochs=10 or max_steps=1000",
        ),
        (["max_steps=0"], r"max_steps=0: must be > 0 or null\. Fix: pass max_steps=1000"),
        (["num_epochs=0"], r"num_epochs=0: must be > 0 or null\. Fix: pass num_epochs=10"),
        (["eval_every_n_steps=-5"], r"eval_every_n_steps=-5: must be >= 0 \(0: at epoch ends\)"),
        (["scheduler.warmup_fraction=1.5"], r"scheduler.warmup_fraction=1.5: must be in \[0, 1\)"),
    ],
)
def test_length_config_errors_name_the_key_the_value_and_the_fix(override, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(override))
