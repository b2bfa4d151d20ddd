"""logger=[tensorboard,wandb] in real runs (issue 47, item 4), offline (no key here), read back from W&B's
own files with its protobuf schema (ddplab.wandb_files): every scalar TensorBoard has at the same step, the
config, tags, the HParams entry, provenance and the model artifact; a resume continues the same W&B run with
each step once; a W&B that cannot start online within wandb.init_timeout_s logs the run offline, says so."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers.extras import needs
from helpers.jobs import compose_cfg, run_killed_after_step
from helpers.tracking import TRACKED_RUN, free_port

import ddplab
from ddplab import wandb_files as wf
from ddplab.events import read_scalars

needs("wandb", "wandb")

BASE = [*TRACKED_RUN, "logger=[tensorboard,wandb]"]


@pytest.fixture(autouse=True)
def no_wandb_key(tmp_path, monkeypatch):
    """No key anywhere (wandb.mode=auto goes offline), W&B's own folders in the test's tmp dir."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


def files_of(run_dir: Path) -> list[Path]:
    return wf.run_files(run_dir, json.loads((run_dir / "wandb.json").read_text())["run_id"])


def history_of(run_dir: Path) -> dict[int, dict[str, float]]:
    """Every attempt's history, merged; each (step, key) must be in one file only."""
    rows: dict[int, dict[str, float]] = {}
    for file in files_of(run_dir):
        for step, row in wf.history(file).items():
            twice = set(row) & set(rows.get(step, {}))
            assert not twice, f"step {step} sent twice: {sorted(twice)}"
            rows.setdefault(step, {}).update(row)
    return rows


def assert_same_as_tensorboard(run_dir: Path, skip: str = "\0") -> None:
    tb = read_scalars(run_dir / "tb")
    rows = history_of(run_dir)
    logged = {(step, key) for step, row in rows.items() for key in row}
    assert logged == {(s, k) for k, points in tb.items() for s, _ in points}
    for key, points in tb.items():  # TensorBoard keeps float32: the same numbers, rounded as it rounds them
        if not key.startswith(skip):
            assert [np.float32(rows[s][key]) for s, _ in points] == [np.float32(v) for _, v in points], key


@pytest.mark.slow
def test_the_wandb_run_holds_tensorboards_scalars_the_config_tags_and_model(tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="ddplab.tracking"):
        ddplab.run(compose_cfg(BASE + ["wandb.tags=[baseline,mlp]"], run_dir))
    [file] = files_of(run_dir)
    assert file.parent.name.startswith("offline-run-")  # no key: offline
    assert_same_as_tensorboard(run_dir)
    assert len(read_scalars(run_dir / "tb")) > 10
    run = wf.run_record(file)
    assert list(run.tags) == ["baseline", "mlp"] and run.display_name == "run" and run.project == "ddplab"
    assert run.run_group == ""  # a single run has no group (sweeps and studies: tests/unit/test_wandb.py)
    config = wf.config(file)
    assert config["config"]["optimizer"]["lr"] == 0.1 and config["config"]["model"]["_target_"] == (
        "ddplab.models.MLP"
    )
    assert config["hparams"]["model"] == "MLP" and len(config["provenance"]["code"]["commit"]) == 40
    # the model, as `python -m ddplab export` writes it, as the artifact model-<run id>
    [art] = [r.artifact for r in wf.read_records(file) if r.WhichOneof("record_type") == "artifact"]
    assert art.name == f"model-{run.run_id}" and art.type == "model"
    assert sorted(e.path for e in art.manifest.contents) == ["README.md", "config.yaml", "model.safetensors"]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wandb:")]
    assert said == [f"wandb: this run was logged offline; to send it to W&B: wandb sync {file.parent}"]


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run_with_each_step_once(tmp_path):
    args = BASE + ["checkpoint.every_n_steps=4"]
    ddplab.run(compose_cfg(args, tmp_path / "ref"))
    # Crashed after step 11: its last checkpoint is step 8's, but it had logged step 10 to W&B already; the
    # resume recomputes steps 9-12 (bitwise) and must not send step 10 again.
    run_killed_after_step(compose_cfg(args, tmp_path / "run"), 11)
    [crashed] = files_of(tmp_path / "run")
    assert max(wf.history(crashed)) == 10
    ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path / "run"))
    first, resumed = files_of(tmp_path / "run")
    assert first == crashed and wf.run_record(resumed).run_id == wf.run_record(first).run_id
    assert min(wf.history(resumed)) == 12  # steps 11 logs nothing (log every 2); 10 is the crashed one's
    # step 10's times: the crashed attempt's in W&B (sent first), the resume's in TensorBoard (it purged them)
    assert_same_as_tensorboard(tmp_path / "run", skip="vitals/")
    ref, got = history_of(tmp_path / "ref"), history_of(tmp_path / "run")
    assert sorted(ref) == sorted(got)
    for step, row in ref.items():  # bitwise the same run, but its times
        assert {k: v for k, v in got[step].items() if not k.startswith("vitals/")} == {
            k: v for k, v in row.items() if not k.startswith("vitals/")
        }, step


@pytest.mark.slow
def test_a_wandb_that_cannot_start_online_logs_the_run_offline(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # a key: auto goes online, to a server that never answers
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="ddplab.tracking"):
        result = ddplab.run(compose_cfg(BASE + ["wandb.init_timeout_s=3"], run_dir))
    assert result["step"] == 12
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wandb:")]
    assert len(said) == 2 and said[0].startswith("wandb: could not start online ("), said
    assert said[0].endswith("); this run is logged offline")
    offline = [f for f in files_of(run_dir) if f.parent.name.startswith("offline-run-")]
    assert said[1] == f"wandb: this run was logged offline; to send it to W&B: wandb sync {offline[0].parent}"
    assert_same_as_tensorboard(run_dir)


@pytest.mark.slow
def test_a_wandb_that_never_started_gets_the_whole_run_from_sync(tmp_path, caplog):
    """W&B could not start at all (its folder in the run dir is a file): training goes on, the outage and the
    end are said, the end with the command; ``python -m ddplab sync`` then sends TensorBoard's record, each
    step once."""
    import sys

    from helpers.jobs import assert_ok, run_cmd

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb").write_text("not a folder")
    with caplog.at_level(logging.INFO, logger="ddplab.tracking"):
        result = ddplab.run(compose_cfg(BASE + ["wandb.close_timeout_s=5"], run_dir))
    assert result["step"] == 12
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wandb:")]
    assert len(said) == 2 and said[0].startswith("wandb: cannot reach W&B (offline) ("), said
    assert said[1].endswith(f"python -m ddplab sync {run_dir} sends them, each step once"), said
    (run_dir / "wandb").unlink()
    synced = run_cmd([sys.executable, "-m", "ddplab", "sync", str(run_dir)], tmp_path)
    assert_ok(synced)
    assert synced.stdout.startswith("sync: W&B run ") and "(offline)" in synced.stdout
    assert_same_as_tensorboard(run_dir)


@pytest.mark.slow
def test_samples_at_each_evaluation_are_wandb_panels_at_their_step(tmp_path):
    """callbacks=[samples] with W&B: each evaluation's continuation is an HTML panel at that step, holding
    TensorBoard's text (escaped)."""
    import html

    from helpers.compare import tb_texts

    lm = [
        "task=lm",
        "model=gpt",
        "dataset=text",
        "dataset.block_size=32",
        "model.n_embd=32",
        "model.n_head=2",
    ]
    samples = [
        "callbacks=[samples]",
        "callbacks.samples.prompt=The captain",
        "callbacks.samples.max_new_tokens=8",
    ]
    run_dir = tmp_path / "run"
    ddplab.run(compose_cfg([*lm, *BASE[1:], *samples], run_dir))
    [file] = files_of(run_dir)
    panels: dict[int, dict[str, str]] = {}  # W&B writes a media value as its fields: samples.path, ...
    for r in wf.read_records(file):
        for item in r.history.item if r.WhichOneof("record_type") == "history" else ():
            if list(item.nested_key[:1]) == ["samples"]:
                panels.setdefault(r.history.step.num, {})[item.nested_key[1]] = json.loads(item.value_json)
    said = tb_texts(run_dir / "tb", "samples")
    assert sorted(panels) == sorted(said) == [6, 12]
    for step, panel in panels.items():
        assert panel["_type"] == "html-file"
        page = (file.parent / "files" / panel["path"]).read_text()
        assert html.escape(said[step]) in page, step


@pytest.mark.slow
def test_a_wandb_that_hangs_mid_run_holds_the_end_only_its_timeout_and_leaves_no_process(
    tmp_path, monkeypatch, caplog
):
    """W&B's client stuck at its first log call (tests/workers/hanging_wandb_client.py): training goes on,
    the end waits wandb.close_timeout_s and says what W&B lacks with the command, and the stuck process is
    gone after the run (it ignores SIGTERM, as the real one does)."""
    import subprocess
    import sys
    import time

    from helpers.jobs import REPO

    from ddplab import tracking_wandb

    started: list[subprocess.Popen] = []

    def hanging(self) -> None:
        worker = REPO / "tests" / "workers" / "hanging_wandb_client.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        started.append(self.proc)

    monkeypatch.setattr(tracking_wandb._Child, "__init__", hanging)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="ddplab.tracking"):
        result = ddplab.run(compose_cfg(BASE + ["wandb.close_timeout_s=3"], run_dir))
    assert result["step"] == 12 and time.monotonic() - t0 < 30
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wandb:")]
    assert len(said) == 1 and "did not take the run's last" in said[0], said
    assert said[0].endswith(f"python -m ddplab sync {run_dir} sends them, each step once")
    [proc] = started
    assert proc.wait(timeout=10) is not None  # killed at the end: no process left behind


@pytest.mark.slow
def test_a_sweeps_jobs_are_wandb_runs_of_one_group(tmp_path):
    import sys

    from helpers.jobs import REPO, assert_ok, run_cmd

    sweep = tmp_path / "multirun" / "day" / "time"
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "-m",
        "optimizer.lr=0.1,0.05",
        *BASE,
        "wandb.log_model=false",
    ]
    assert_ok(run_cmd([*cmd, f"hydra.sweep.dir={sweep}"], tmp_path))
    runs = [wf.run_record(files_of(sweep / job)[0]) for job in ("0", "1")]
    assert [r.run_group for r in runs] == ["sweep day/time"] * 2 and runs[0].run_id != runs[1].run_id
    lrs = [wf.config(files_of(sweep / job)[0])["hparams"]["optimizer.lr"] for job in ("0", "1")]
    assert lrs == [0.1, 0.05]


@pytest.mark.slow
def test_a_studys_trials_are_wandb_runs_of_one_group_holding_their_params(tmp_path):
    """mode=study with W&B: each trial a W&B run of the group ``study <name>``, its config holding the
    trial's params and its last val/acc the trial's value."""
    import sys

    from helpers.jobs import REPO, assert_ok, run_cmd
    from helpers.study import load, study_args

    d = tmp_path / "study"
    cmd = [sys.executable, str(REPO / "train.py"), *study_args(d, 2), "logger=[tensorboard,wandb]"]
    assert_ok(run_cmd([*cmd, "wandb.log_model=false"], tmp_path))
    for t in load(d).trials:
        [file] = files_of(Path(t.user_attrs["ddplab:dir"]))
        assert wf.run_record(file).run_group == "study digits_lr_wd"
        config = wf.config(file)["config"]  # the trial's composed config: its params drawn in
        assert {k: config[k.split(".")[0]][k.split(".")[1]] for k in t.params} == t.params
        assert wf.history(file)[max(wf.history(file))]["val/acc"] == pytest.approx(t.value, rel=1e-6)


@pytest.mark.dist
def test_a_preempted_torchrun_job_resumed_keeps_one_wandb_run_each_step_once(tmp_path):
    """torchrun, 2 ranks, the launcher SIGTERMed at step 9 (a preemption: every rank checkpoints and stops,
    W&B's client ending its run within the grace), then resume=auto: one W&B run over the two attempts, each
    (step, key) once, TensorBoard's values at every step."""
    from helpers.jobs import assert_ok, torchrun

    fault = tmp_path / "fault"
    fault.mkdir()
    spec = {
        "phase": "optimizer",
        "k": 9,
        "rank": 0,
        "target": "launcher",
        "signal": "SIGTERM",
        "dir": str(fault),
    }
    inject = {"SOAK_FAULT": json.dumps(spec), "SOAK_TRIAL_ID": str(fault), "SOAK_DIR": str(fault)}
    run_dir = tmp_path / "run"
    args = [*BASE, "+callbacks.soak._target_=soak_toy.SoakCallback", f"hydra.run.dir={run_dir}"]
    stopped = torchrun(2, args, tmp_path, timeout=240, extra_env=inject)
    assert stopped.returncode != 0 and (fault / "fired").exists(), stopped.stderr[-2000:]
    assert json.loads((run_dir / "result.json").read_text())["status"] == "preempted"
    assert_ok(torchrun(2, [*args, "resume=auto"], tmp_path, timeout=240))
    assert len(files_of(run_dir)) == 2
    assert_same_as_tensorboard(run_dir, skip="vitals/")


@pytest.mark.slow
def test_a_full_disk_under_the_wandb_client_is_an_error_reply_not_a_traceback_on_the_jobs_output(
    tmp_path, capfd
):
    """Found by the soak (W&B beside a full disk): wandb's own log handler failing to write printed Python's
    "--- Logging error ---", a traceback and the whole config it was logging, into the job's output."""
    from helpers.disk import fill
    from helpers.jobs import tmpfs

    from ddplab.tracking_wandb import WandbError, WandbWriter, _Child

    settings = WandbWriter._settings(SimpleNamespace(init_timeout=60.0))
    with tmpfs(tmp_path / "disk", "size=4m") as disk:
        child = _Child()
        try:
            child.call("start", {"project": "p", "id": "full0disk", "dir": str(disk)}, settings, False)
            fill(disk / "filler")
            # a config as long as a real one's (the log line holds it whole: more than the page left)
            big = {f"key_{i}": "x" * 64 for i in range(200)} | {"secret_note": "never printed"}
            for call, args in (("config", (big,)), ("log", ({"train/loss": 1.0}, 1)), ("finish", (0,))):
                with contextlib.suppress(WandbError):  # a failure is the reply's, said by the writer
                    child.call(call, *args)
        finally:
            child.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err and "never printed" not in err, err[-2000:]
