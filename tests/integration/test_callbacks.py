"""Callbacks and the features built on them, in real runs: EMA (a reference by hand, val_ema/*, bitwise
resume, FSDP), a user's callback's hooks and state, early stopping on every rank, the profiler's traces, no
collective between log steps, and fast_dev_run's validation batches."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.callbacks import BASE
from helpers.compare import load
from helpers.counting import assert_quiet_between_log_steps, count_steps
from helpers.jobs import assert_ok, compose_cfg, read_scalars, run_cmd, run_killed_after_step, torchrun_cmd

import ddplab


# ------------------------------------------------------------------------------------- EMA
@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_ema_equals_a_reference_computed_by_hand_from_every_steps_weights(tmp_path):
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    seen: list[list[torch.Tensor]] = []

    def snap(opt, *_):
        seen.append([p.detach().clone() for g in opt.param_groups for p in g["params"]])

    pre = register_optimizer_step_pre_hook(lambda opt, *_: None if seen else snap(opt))  # the initial weights
    post = register_optimizer_step_post_hook(snap)
    try:
        # decay 0.5: the warm-up (1 + n) / (10 + n) reaches it at update 8, so both regimes are checked.
        out = ddplab.run(
            compose_cfg(
                BASE
                + ["num_epochs=1", "callbacks=[ema]", "callbacks.ema.decay=0.5", "objective=val_ema/acc"],
                tmp_path / "r",
            )
        )
    finally:
        pre.remove(), post.remove()
    initial, steps = seen[0], seen[1:]
    assert len(steps) == 22
    shadow, decays = [t.clone() for t in initial], []
    for n, weights in enumerate(steps):
        decays.append(min(0.5, (1 + n) / (10 + n)))
        shadow = [torch.lerp(s, w, 1 - decays[-1]) for s, w in zip(shadow, weights, strict=True)]
    assert decays.count(0.5) == 14 and decays[0] == 0.1  # warm-up for 8 updates, then the decay itself
    ck = load(tmp_path / "r" / "checkpoints" / "last.pt")["callbacks.ema"]
    assert ck["updates"] == 22 and len(ck["shadow"]) == len(shadow) == 6  # 3 Linear layers: weights, biases
    for got, want in zip(ck["shadow"], shadow, strict=True):
        assert torch.equal(got, want.cpu())  # the checkpoint loads on the CPU; the weights were on the device
    assert out["val_ema/acc"] > 0.5 and out["val_ema/acc_best"] == out["val_ema/acc"]


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_val_ema_metrics_are_the_ema_weights_evaluated(tmp_path):
    """val_ema/* is what the evaluation gives with the EMA shadow as the model's weights: put the shadow into
    a copy of the checkpoint and evaluate that with mode=eval."""
    run, ema = tmp_path / "r", tmp_path / "ema"
    out = ddplab.run(compose_cfg(BASE + ["num_epochs=1", "callbacks=[ema]", "callbacks.ema.decay=0.5"], run))
    shutil.copytree(run, ema)
    ck = load(ema / "checkpoints" / "last.pt")
    model = ck["model"]
    # the MLP's parameters, in order; no buffers
    names = [k for k, v in model.items() if v.is_floating_point()]
    assert len(names) == len(ck["callbacks.ema"]["shadow"]) == 6
    for k, shadow in zip(names, ck["callbacks.ema"]["shadow"], strict=True):
        model[k] = shadow
    torch.save(ck, ema / "checkpoints" / "last.pt")
    got = ddplab.run(compose_cfg(["mode=eval", f"resume={ema}", "progress=none"], tmp_path / "eval"))
    assert got["val/acc"] == out["val_ema/acc"] and got["val/loss"] == pytest.approx(
        out["val_ema/loss"], rel=1e-6
    )
    assert out["val_ema/acc"] != out["val/acc"]  # the live weights give another answer: the swap is real


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_ema_is_restored_bitwise_on_resume(tmp_path):
    args = BASE + ["num_epochs=2", "callbacks=[ema]", "checkpoint.every_n_steps=5"]
    ddplab.run(compose_cfg(args, tmp_path / "ref"))
    run_killed_after_step(compose_cfg(args, tmp_path / "run"), 32)  # the last checkpoint was at step 30
    ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path / "run"))
    a = load(tmp_path / "run" / "checkpoints" / "last.pt")["callbacks.ema"]
    b = load(tmp_path / "ref" / "checkpoints" / "last.pt")["callbacks.ema"]
    assert a["updates"] == b["updates"] == 44
    assert all(torch.equal(x, y) for x, y in zip(a["shadow"], b["shadow"]))


@pytest.mark.dist
def test_ema_under_fsdp_is_sharded_and_matches_ddp(tmp_path):
    args = BASE + ["num_epochs=2", "callbacks=[ema]", "model.dropout=0"]
    for strategy in ("ddp", "fsdp"):
        assert_ok(
            run_cmd(
                torchrun_cmd(2, args + [f"distributed={strategy}", f"hydra.run.dir={tmp_path / strategy}"]),
                tmp_path,
                timeout=240,
            )
        )
    a = load(tmp_path / "fsdp" / "checkpoints" / "last.pt")["callbacks.ema"]["shadow"]
    b = load(tmp_path / "ddp" / "checkpoints" / "last.pt")["callbacks.ema"]["shadow"]
    # whole tensors in the checkpoint, not one rank's shard
    assert [t.shape for t in a] == [t.shape for t in b]
    for x, y in zip(a, b):
        assert ((x - y).abs().max() / y.abs().max()).item() < 1e-5
    s = read_scalars(tmp_path / "fsdp" / "tb")
    assert [st for st, _ in s["val_ema/acc"]] == [22, 44]


# ------------------------------------------------------------------------- a user's callback
@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_users_callback_receives_every_hook_in_order(tmp_path):
    import toy

    rec = ["+callbacks.rec._target_=toy.Recorder", "log_every_n_steps=10", "checkpoint.every_n_steps=0"]
    toy.RECORDED.clear()
    ddplab.run(compose_cfg(BASE + ["num_epochs=2", "stop_after_epochs=1", *rec], tmp_path / "r"))
    first = list(toy.RECORDED)
    toy.RECORDED.clear()
    ddplab.run(compose_cfg(BASE + ["num_epochs=2", "resume=auto", *rec], tmp_path / "r"))  # its second epoch
    again = list(toy.RECORDED)
    toy.RECORDED.clear()
    toy._FAULTED.clear()  # FaultyMLP faults once per process
    with pytest.raises(RuntimeError, match="injected crash"):
        ddplab.run(
            compose_cfg(
                BASE + ["model._target_=toy.FaultyMLP", "+model.fault=crash", "+model.fault_rank=0", *rec],
                tmp_path / "crash",
            )
        )
    steps = [("on_step_end", s) for s in range(1, 23)]
    for s in (10, 20):  # a log step's on_log follows its on_step_end
        steps.insert(steps.index(("on_step_end", s)) + 1, ("on_log", s))
    assert first == [
        ("setup", 0),
        ("on_fit_start", 0),
        *steps,
        ("on_log", 22),
        ("on_eval_end", 22),
        ("on_save", 22),
        ("on_fit_end", 22),
    ]
    assert again[:3] == [("setup", 0), ("on_load", 22), ("on_fit_start", 22)] and again[-1] == (
        "on_fit_end",
        44,
    )
    assert again.count(("on_step_end", 23)) == 1 and ("on_step_end", 22) not in again
    assert toy.RECORDED[-1][0] == "on_exception" and "on_fit_end" not in dict(toy.RECORDED)


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_callbacks_setup_sees_the_whole_state_and_on_load_the_resumed_one(tmp_path):
    """build_state hands the callbacks a State with every part in place (the writer, the checkpoint manager,
    the events dir: nothing filled in later), and ON_LOAD the resumed position."""
    import toy

    rec = ["+callbacks.rec._target_=toy.Recorder", "checkpoint.every_n_steps=0"]
    toy.UNSET_AT_SETUP.clear()
    toy.RECORDED.clear()
    ddplab.run(compose_cfg(BASE + ["num_epochs=2", "stop_after_epochs=1", *rec], tmp_path / "r"))
    ddplab.run(compose_cfg(BASE + ["num_epochs=2", "resume=auto", *rec], tmp_path / "r"))
    # a stop reason is set only by request_stop
    assert toy.UNSET_AT_SETUP == [["stop_reason"], ["stop_reason"]]
    assert [h for h in toy.RECORDED if h[0] in ("setup", "on_load")] == [
        ("setup", 0),
        ("setup", 0),
        ("on_load", 22),
    ]


# ------------------------------------------------------------------------- early stopping
def _early_stop(tmp_path: Path, *args: str, epochs: int = 4) -> dict:
    ddplab.run(
        compose_cfg(
            BASE
            + [
                f"num_epochs={epochs}",
                "callbacks=[early_stopping]",
                "callbacks.early_stopping.monitor=val/acc",
                *args,
            ],
            tmp_path / "r",
        )
    )
    return json.loads((tmp_path / "r" / "result.json").read_text())


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_early_stopping_mode_says_which_way_is_better(tmp_path):
    """val/acc rises from epoch 1 to 2 here: under mode=max that is an improvement (no stop at the second
    check); under mode=min it is a worse value, so patience=1 stops the run there."""
    up = _early_stop(
        tmp_path / "max", "callbacks.early_stopping.mode=max", "callbacks.early_stopping.patience=1", epochs=2
    )
    down = _early_stop(
        tmp_path / "min", "callbacks.early_stopping.mode=min", "callbacks.early_stopping.patience=1"
    )
    accs = [v for _, v in read_scalars(tmp_path / "max" / "r" / "tb")["val/acc"]]
    assert len(accs) == 2 and accs[1] > accs[0]
    assert up["metrics"]["epoch"] == 2 and "note" not in up
    assert down["metrics"]["epoch"] == 2
    assert down["note"].startswith(
        "stopped early at epoch 2: val/acc did not improve by more than 0.0 for 1 checks"
    )


@pytest.mark.slow  # 1.4-2.1 s in the inner loop: a second or more, as the marker says
def test_early_stopping_divergence_threshold_stops_at_the_first_check_past_it(tmp_path):
    """mode=max: a value below the threshold has diverged (for mode=min, above it)."""
    res = _early_stop(
        tmp_path, "callbacks.early_stopping.mode=max", "callbacks.early_stopping.divergence_threshold=0.999"
    )
    assert res["metrics"]["epoch"] == 1 and res["status"] == "completed"
    assert (
        res["note"].startswith("stopped early at epoch 1: val/acc=")
        and "crossed divergence_threshold=0.999" in res["note"]
    )


@pytest.mark.dist
def test_early_stopping_stops_every_rank_at_the_same_step_and_says_so(tmp_path):
    # min_delta=1.0: the loss never improves by that much, so the second evaluation stops the job.
    args = BASE + [
        "num_epochs=10",
        "callbacks=[early_stopping]",
        "callbacks.early_stopping.patience=1",
        "callbacks.early_stopping.min_delta=1.0",
        "distributed.timeout_s=20",
        f"hydra.run.dir={tmp_path / 'r'}",
    ]
    proc = run_cmd(torchrun_cmd(2, args), tmp_path, timeout=120)
    # A rank that trained on would block the other in a collective until distributed.timeout_s: the job
    # would fail naming the timeout (no wall-clock bound: that flakes on 2 loaded cores).
    assert_ok(proc)
    assert "timed out" not in (proc.stdout + proc.stderr).lower()
    res = json.loads((tmp_path / "r" / "result.json").read_text())
    assert res["status"] == "completed" and res["metrics"]["step"] == 44 and res["metrics"]["epoch"] == 2
    assert res["note"].startswith(
        "stopped early at epoch 2: val/loss did not improve by more than 1.0 for 1 checks"
    )
    assert [st for st, _ in read_scalars(tmp_path / "r" / "tb")["val/loss"]] == [22, 44]


# ------------------------------------------------------------------------------- profiler
@pytest.mark.dist
def test_profiler_writes_one_trace_per_rank_that_parses(tmp_path):
    args = BASE + [
        "num_epochs=1",
        "callbacks=[profiler]",
        "callbacks.profiler.steps=[3,5]",
        f"hydra.run.dir={tmp_path / 'r'}",
        "progress=log",
    ]
    proc = run_cmd(torchrun_cmd(2, args), tmp_path, timeout=120)
    assert_ok(proc)
    for rank in (0, 1):
        trace = json.loads((tmp_path / "r" / "profile" / f"trace-rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any("Optimizer.step" in n for n in names), sorted(names)[:20]
    assert (
        f"profiler: steps 3-5 of rank 0 in {tmp_path / 'r' / 'profile' / 'trace-rank0.json'}"
        in proc.stdout + proc.stderr
    )


@pytest.mark.dist
def test_built_in_callbacks_add_no_collective_or_sync_between_log_steps(tmp_path):
    args = [
        "model=mlp",
        "num_epochs=2",
        "log_every_n_steps=5",
        "progress=log",
        "run_dir=run",
        "callbacks=[ema,early_stopping]",
        "callbacks.early_stopping.monitor=train/loss",
    ]
    # EMA steps and early stops stay quiet
    assert_quiet_between_log_steps(count_steps(tmp_path, 2, args), 22, 2, 5)


def test_fast_dev_run_evaluates_two_batches_of_a_larger_validation_set(tmp_path):
    """The presets' validation sets fit in 2 batches of 256; 2000 samples do not: exactly 2 batches run."""
    out = ddplab.run(
        compose_cfg(
            [
                "model=mlp",
                "dataset=synthetic",
                "dataset.num_val=2000",
                "dataset.image_size=8",
                "debug=fast_dev_run",
                "progress=none",
            ],
            tmp_path / "r",
        )
    )
    assert out["step"] == 2 and out["val/num_samples"] == 2 * 256
