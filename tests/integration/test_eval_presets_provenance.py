"""The eval entry, the experiment and debug presets, and provenance: mode=eval reproduces a run's last
validation metrics at 1 and 3 ranks, with the callbacks it trained with (not those that only serve training);
the presets run; provenance records commit, diff, versions, hosts, command and every rank, ddplab's own
checkout from outside any repository; a callback added on resume starts fresh."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.callbacks import BASE
from helpers.compare import load
from helpers.jobs import CONF, TRAIN, assert_ok, compose_cfg, python_train, run_cmd, torchrun_cmd

import ddplab

# The one 2-rank torchrun run the eval entry evaluates and whose provenance is read: built once, by the one
# worker that takes this group (it only reads the run; the eval writes into its own dirs).
SHARED = "torchrun_mlp_run"


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("torchrun") / "run"
    assert_ok(
        run_cmd(torchrun_cmd(2, BASE + ["num_epochs=2", f"hydra.run.dir={run}"]), run.parent, timeout=180)
    )
    return run


# ---------------------------------------------------------------------------- eval entry
@pytest.mark.dist
@pytest.mark.xdist_group(SHARED)
def test_eval_entry_reproduces_the_last_val_metrics_at_world_sizes_1_and_3(tmp_path, torchrun_run):
    run = torchrun_run
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
@pytest.mark.xdist_group(SHARED)
def test_provenance_lists_every_rank_under_torchrun(torchrun_run):
    prov = json.loads((torchrun_run / "provenance.json").read_text())
    assert prov["launcher"]["kind"] == "torchrun" and prov["world"]["size"] == 2
    assert [r["rank"] for r in prov["world"]["ranks"]] == [0, 1] and prov["world"]["backend"] == "gloo"
    assert len({r["pid"] for r in prov["world"]["ranks"]}) == 2


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_a_callback_added_on_resume_starts_fresh(tmp_path):
    ddplab.run(compose_cfg(BASE + ["num_epochs=2", "stop_after_epochs=1"], tmp_path / "r"))
    out = ddplab.run(compose_cfg(BASE + ["num_epochs=2", "resume=auto", "callbacks=[ema]"], tmp_path / "r"))
    ema = load(tmp_path / "r" / "checkpoints" / "last.pt")["callbacks.ema"]
    assert out["step"] == 44 and ema["updates"] == 22  # only the steps since it joined
