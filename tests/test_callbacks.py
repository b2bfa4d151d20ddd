"""Callbacks and the features built on them (EMA, early stopping, profiler), the eval entry,
experiment/debug presets and provenance."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.compare import load
from helpers.counting import assert_quiet_between_log_steps, count_steps
from helpers.jobs import (
    CONF,
    TRAIN,
    assert_ok,
    compose_cfg,
    python_train,
    read_scalars,
    run_cmd,
    run_killed_after_step,
    torchrun_cmd,
)

import ddplab

BASE = ["model=mlp", "progress=none"]  # digits: 22 steps per epoch


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


# ---------------------------------------------------------------------------- eval entry
@pytest.mark.dist
def test_eval_entry_reproduces_the_last_val_metrics_at_world_sizes_1_and_3(tmp_path):
    run = tmp_path / "run"
    assert_ok(
        run_cmd(torchrun_cmd(2, BASE + ["num_epochs=2", f"hydra.run.dir={run}"]), tmp_path, timeout=180)
    )
    last = json.loads((run / "result.json").read_text())["metrics"]
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    for n in (1, 3):
        out = tmp_path / f"eval{n}"
        # Only the checkpoint is named: model, data and task come from its own config.
        cmd = [sys.executable, str(TRAIN)] if n == 1 else torchrun_cmd(n, [])
        proc = run_cmd(cmd + ["mode=eval", f"resume={run}", f"hydra.run.dir={out}"], tmp_path, timeout=180)
        assert_ok(proc)
        got = json.loads((out / "result.json").read_text())["metrics"]
        assert got["val/num_samples"] == last["val/num_samples"] == 359
        assert got["val/acc"] == last["val/acc"]  # correct / samples: exact
        assert got["val/loss"] == pytest.approx(last["val/loss"], rel=1e-6)
        assert not (out / "checkpoints").exists()
        assert f"evaluation of {run / 'checkpoints' / 'last.pt'}" in proc.stdout + proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == before  # untouched


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_eval_mode_of_a_run_trained_with_ema_evaluates_with_its_callbacks(tmp_path):
    """mode=eval takes the callbacks the run trained with from the checkpoint: EMA's val_ema/* is evaluated
    (from the restored shadow) and may be the objective; a callback the command adds runs beside them."""
    import toy

    run = tmp_path / "r"
    out = ddplab.run(
        compose_cfg(
            BASE + ["num_epochs=1", "callbacks=[ema]", "callbacks.ema.decay=0.5", "objective=val_ema/acc"],
            run,
        )
    )
    toy.RECORDED.clear()
    got = ddplab.run(
        compose_cfg(
            [
                "mode=eval",
                f"resume={run}",
                "progress=none",
                "objective=val_ema/acc",
                "+callbacks.rec._target_=toy.Recorder",
            ],
            tmp_path / "eval",
        )
    )
    assert got["val_ema/acc"] == out["val_ema/acc"] and got["val/acc"] == out["val/acc"], got
    assert got["val_ema/loss"] == pytest.approx(out["val_ema/loss"], rel=1e-6)
    assert out["val_ema/acc"] != out["val/acc"]  # two weights, two answers: the EMA's are the shadow's
    assert ("on_eval_end", 22) in toy.RECORDED


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_eval_mode_leaves_out_the_runs_callbacks_that_only_serve_training(tmp_path):
    """A study trial's reporter (training_only) came back with the run's callbacks: mode=eval of a trial's
    checkpoint would report to its finished trial. The study's own callback says it serves training only."""
    import toy

    from ddplab.study.report import ReportToStudy

    assert ReportToStudy.training_only
    run = tmp_path / "r"
    ddplab.run(compose_cfg(BASE + ["num_epochs=1", "+callbacks.t._target_=toy.TrainingOnlyRecorder"], run))
    assert ("training_only.on_eval_end", 22) in toy.RECORDED  # it did run while training
    toy.RECORDED.clear()
    # The run's own callback is the user's code: their own run dir, so they trust its stored config.
    ddplab.run(
        compose_cfg(
            [
                "mode=eval",
                f"resume={run}",
                "progress=none",
                "+callbacks.rec._target_=toy.Recorder",
                "trust_stored_config=true",
            ],
            tmp_path / "eval",
        )
    )
    assert ("on_eval_end", 22) in toy.RECORDED and not [
        h for h, _ in toy.RECORDED if h.startswith("training_only")
    ]


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_eval_mode_without_a_checkpoint_is_a_clear_error(tmp_path):
    proc = python_train(["mode=eval"], tmp_path, timeout=60)
    assert proc.returncode == 2 and "mode=eval evaluates a checkpoint: name it" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("experiment", ["digits_convnet", "vae_digits", "lm_text"])
@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_experiment_presets_run_under_fast_dev_run(tmp_path, experiment):
    out = ddplab.run(
        compose_cfg([f"experiment={experiment}", "debug=fast_dev_run", "progress=none"], tmp_path / "r")
    )
    assert out["step"] == 2 and out["epoch"] == 1
    assert not (tmp_path / "r" / "checkpoints").exists()  # fast_dev_run writes none
    assert out["val/num_samples"] <= 2 * 256  # 2 evaluation batches at most


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


def test_cifar10_preset_composes_for_when_the_files_exist():
    cfg = compose_cfg(["experiment=cifar10_resnet18"])
    assert cfg.model._target_.endswith("resnet18") and cfg.dataset._target_.endswith("cifar10")
    assert cfg.objective == "val_ema/acc" and "ema" in cfg.callbacks


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_debug_overfit_learns_its_few_batches(tmp_path):
    out = ddplab.run(compose_cfg(BASE + ["debug=overfit", "num_epochs=15"], tmp_path / "r"))
    assert out["val/num_samples"] == 128 and out["val/acc"] == 1.0  # the 2 batches it trained on, learned


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_debug_profiler_preset(tmp_path):
    ddplab.run(compose_cfg(BASE + ["debug=profiler"], tmp_path / "r"))
    assert "traceEvents" in json.loads((tmp_path / "r" / "profile" / "trace-rank0.json").read_text())


# ------------------------------------------------------------------------------ provenance
def test_a_script_outside_any_repository_records_ddplabs_own_checkout(tmp_path, monkeypatch):
    """Issue 45: from a clone with its venv outside it, ``python -m pytest`` is the venv's pytest: provenance
    asked git about that folder and recorded no commit (the MLflow commit tag was empty)."""
    from ddplab import provenance

    (tmp_path / "venv" / "bin").mkdir(parents=True)
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "venv" / "bin" / "pytest")])
    code = provenance.collect([], None)["code"]
    ours = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=Path(ddplab.__file__).parent, capture_output=True, text=True
    ).stdout.strip()
    assert ours and code["commit"] == ours


@pytest.mark.slow
def test_provenance_records_commit_dirty_diff_versions_hosts_and_command(tmp_path):
    repo = tmp_path / "code"
    repo.mkdir()
    shutil.copy(TRAIN, repo / "train.py")
    shutil.copytree(CONF, repo / "conf")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(git + cmd, cwd=repo, check=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    (repo / "conf" / "train.yaml").write_text((repo / "conf" / "train.yaml").read_text() + "# an edit\n")
    run = tmp_path / "run"
    assert_ok(
        run_cmd(
            [sys.executable, str(repo / "train.py"), "model=mlp", "num_epochs=1", f"hydra.run.dir={run}"],
            tmp_path,
            timeout=120,
        )
    )
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["code"]["commit"] == commit and prov["code"]["dirty"] is True
    assert "# an edit" in (run / prov["code"]["diff_file"]).read_text()
    assert prov["packages"]["torch"] == torch.__version__ and prov["packages"]["ddplab"]
    assert prov["launcher"]["kind"] == "python" and prov["world"]["size"] == 1
    assert prov["world"]["ranks"][0]["host"] and "model=mlp" in prov["command"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert "provenance/text_summary" in acc.Tags()["tensors"]


@pytest.mark.dist
def test_provenance_lists_every_rank_under_torchrun(tmp_path):
    run = tmp_path / "run"
    assert_ok(
        run_cmd(torchrun_cmd(2, BASE + ["num_epochs=1", f"hydra.run.dir={run}"]), tmp_path, timeout=120)
    )
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["launcher"]["kind"] == "torchrun" and prov["world"]["size"] == 2
    assert [r["rank"] for r in prov["world"]["ranks"]] == [0, 1] and prov["world"]["backend"] == "gloo"
    assert len({r["pid"] for r in prov["world"]["ranks"]}) == 2


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_a_callback_added_on_resume_starts_fresh(tmp_path):
    ddplab.run(compose_cfg(BASE + ["num_epochs=2", "stop_after_epochs=1"], tmp_path / "r"))
    out = ddplab.run(compose_cfg(BASE + ["num_epochs=2", "resume=auto", "callbacks=[ema]"], tmp_path / "r"))
    ema = load(tmp_path / "r" / "checkpoints" / "last.pt")["callbacks.ema"]
    assert out["step"] == 44 and ema["updates"] == 22  # only the steps since it joined
