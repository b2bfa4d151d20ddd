"""logger=[tensorboard,mlflow] in real runs (issue 34, item 4), against an `mlflow server` on loopback with a
SQLite backend started here: the same scalars as TensorBoard, config as params, tags; one MLflow run per job,
per sweep job (grouped by the sweep) and per study trial; a resume continues the same run with each step once,
a full disk at the run id's write included; a server that is down or hangs never stops training, is said when
it begins and at the end (what is left, and the command that sends it: test_mlflow_outage) and holds a stop's
exit only within the launcher's grace; 2 ranks log the last checkpoint's model once."""

from __future__ import annotations

import json
import random
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers.compare import load, same
from helpers.extras import lazy
from helpers.jobs import REPO, assert_ok, compose_cfg, run_cmd, run_killed_after_step
from helpers.tracking import TRACKED_RUN, free_port

import ddplab
from ddplab.events import read_scalars

tracking = lazy("mlflow.tracking", "mlflow")


def MlflowClient(uri: str):  # noqa: N802 (MLflow's class, imported at its first use)
    return tracking.MlflowClient(uri)


BASE = [*TRACKED_RUN, "logger=[tensorboard,mlflow]"]


def run_of(run_dir: Path, uri: str):
    client = MlflowClient(uri)
    return client, client.get_run(json.loads((run_dir / "mlflow.json").read_text())["run_id"])


def history(client, run, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


@pytest.mark.slow
def test_the_mlflow_run_holds_tensorboards_scalars_the_config_and_tags(tmp_path, mlflow_server):
    run_dir = tmp_path / "run"
    ddplab.run(compose_cfg(BASE + [f"mlflow.tracking_uri={mlflow_server}"], run_dir))
    client, run = run_of(run_dir, mlflow_server)
    tb = read_scalars(run_dir / "tb")
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    experiment = client.get_experiment(run.info.experiment_id)
    # a model-training experiment: MLflow's UI opens on the runs table, not on GenAI traces
    assert experiment.name == "ddplab"
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert set(run.data.metrics) == set(tb) and len(tb) > 10
    for key, points in tb.items():  # TensorBoard keeps float32: the same numbers, rounded as it rounds them
        got = history(client, run, key)
        assert [s for s, _ in got] == [s for s, _ in points], key
        assert [np.float32(v) for _, v in got] == [np.float32(v) for _, v in points], key
    assert (
        run.data.params["optimizer.lr"] == "0.1" and run.data.params["model._target_"] == "ddplab.models.MLP"
    )
    assert run.data.tags["ddplab.run_dir"] == str(run_dir) and run.data.tags["hparam.model"] == "MLP"
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40
    # The model, as `python -m ddplab export` writes it, is the artifact model/.
    from safetensors.torch import load_file

    from ddplab.checkpoint.export import export

    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "model")) == [
        "model/README.md",
        "model/config.yaml",
        "model/model.safetensors",
    ]
    got = load_file(client.download_artifacts(run.info.run_id, "model/model.safetensors", str(tmp_path)))
    want = load_file(export(run_dir, "safetensors", tmp_path / "want")[0] / "model.safetensors")
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
    assert run.data.tags["ddplab.model"].startswith("model/ (safetensors): ")


@pytest.mark.slow
def test_a_resumed_run_continues_its_mlflow_run_with_each_step_once(tmp_path, mlflow_server):
    args = BASE + [f"mlflow.tracking_uri={mlflow_server}", "checkpoint.every_n_steps=4"]
    ddplab.run(compose_cfg(args, tmp_path / "ref"))
    # Crashed after step 11: its last checkpoint is step 8's, but it had logged step 10 to MLflow already; the
    # resume recomputes steps 9-12 (bitwise) and must not send step 10 again.
    run_killed_after_step(compose_cfg(args, tmp_path / "run"), 11)
    client, crashed = run_of(tmp_path / "run", mlflow_server)
    assert history(client, crashed, "train/loss")[-1][0] == 10
    first = crashed.info.run_id
    ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path / "run"))
    client, run = run_of(tmp_path / "run", mlflow_server)
    _, ref = run_of(tmp_path / "ref", mlflow_server)
    assert run.info.run_id == first and run.info.status == "FINISHED"
    for key in ref.data.metrics:
        if key.startswith("vitals/"):
            continue  # times differ between runs
        assert history(client, run, key) == history(client, ref, key), key  # each step once, bitwise the same


@pytest.mark.slow
def test_a_full_disk_at_the_run_id_write_loses_no_step_and_a_resume_finds_the_run(
    tmp_path, mlflow_server, monkeypatch, caplog
):
    """The soak's seed 753188260: a full disk met `mlflow.json`'s write, which left it empty; the resume could
    not read it and MLflow logging stopped. Here the disk is full at exactly that write (the file truncated,
    as a write would leave it, then ENOSPC), the job crashes after step 11, and the resume meets the record as
    a ddplab that wrote in place left it (empty): the MLflow run still holds each step once and FINISHED."""
    args = BASE + [
        f"mlflow.tracking_uri={mlflow_server}",
        "checkpoint.every_n_steps=4",
        "mlflow.log_model=false",
    ]
    ddplab.run(compose_cfg(args, tmp_path / "ref"))
    real = Path.write_text

    def full_at_the_record(self, *a, **k):
        if "mlflow.json" in self.name:
            self.open("w").close()
            raise OSError(28, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", full_at_the_record)
    run = tmp_path / "run"
    run_killed_after_step(compose_cfg(args, run), 11)
    monkeypatch.undo()
    client = MlflowClient(mlflow_server)
    mine = client.search_runs(
        [client.get_experiment_by_name("ddplab").experiment_id], f"tags.`ddplab.run_dir` = '{run}'"
    )
    assert len(mine) == 1 and history(client, mine[0], "train/loss")[-1][0] == 10  # logging went on
    (run / "mlflow.json").write_text("")
    ddplab.run(compose_cfg(args + ["resume=auto"], run))
    got, ref = run_of(run, mlflow_server)[1], run_of(tmp_path / "ref", mlflow_server)[1]
    assert got.info.run_id == mine[0].info.run_id and got.info.status == "FINISHED"
    for key in ref.data.metrics:
        if not key.startswith("vitals/"):
            assert history(client, got, key) == history(client, ref, key), key
    assert not [r for r in caplog.records if r.name == "ddplab.tracking" and r.levelno >= 30]


@pytest.mark.slow
def test_a_sweep_is_one_experiment_with_a_run_per_job(tmp_path, mlflow_server):
    proc = run_cmd(
        [
            sys.executable,
            str(REPO / "train.py"),
            "-m",
            "optimizer.lr=0.1,0.05",
            *BASE,
            f"mlflow.tracking_uri={mlflow_server}",
            "mlflow.log_model=false",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        tmp_path,
    )
    assert_ok(proc)
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name(f"sweep {(tmp_path / 'sweep').resolve()}")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.params["optimizer.lr"] for r in runs) == ["0.05", "0.1"]
    assert [client.list_artifacts(r.info.run_id, "model") for r in runs] == [[], []]  # mlflow.log_model=false
    assert sorted(r.data.tags["hparam.optimizer.lr"] for r in runs) == ["0.05", "0.1"]


def hanging_server() -> int:
    """A port that accepts connections and never answers (a tracking server that hangs)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held: list = []
    threading.Thread(target=lambda: [held.append(sock.accept()) for _ in iter(int, 1)], daemon=True).start()
    return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["down", "hanging"])
def test_a_tracking_server_down_or_hanging_never_stops_training_and_is_said_at_its_start_and_end(
    tmp_path, caplog, kind
):
    port = free_port() if kind == "down" else hanging_server()
    # down: refused at once (MLflow's brief retries, then one line); hanging: the end waits 3 s, no more
    args = BASE + [
        f"mlflow.tracking_uri=http://127.0.0.1:{port}",
        f"mlflow.close_timeout_s={30 if kind == 'down' else 3}",
    ]
    out = ddplab.run(compose_cfg(args, tmp_path / "run"))
    drawn = random.getstate()  # after the run: MLflow's thread has given up by then
    assert (
        out["step"] == 12
        and json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "completed"
    )
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mlflow: ")]
    # down: the outage once, when it begins, and once at the end what MLflow lacks and the command that sends
    # it; hanging: the end's line only (the thread is still waiting on its first request)
    end = f"python -m ddplab sync {tmp_path / 'run'} sends them, each step once"
    if kind == "down":
        assert len(said) == 2 and said[0].startswith(f"mlflow: cannot reach http://127.0.0.1:{port}"), said
    assert "did not take the run's last" in said[-1] and said[-1].endswith(end) and len(said) <= 2, said
    assert [s for s, _ in read_scalars(tmp_path / "run" / "tb")["train/loss"]] == [2, 4, 6, 8, 10, 12]
    if kind == "down":
        # The retries' jitter (urllib3's, MLflow's) drew from Python's global `random`, from MLflow's thread
        # at any moment: the rank's RNG, which its checkpoint holds and user code draws from, followed the
        # server's health.
        ddplab.run(compose_cfg([a for a in BASE if not a.startswith("logger=")], tmp_path / "plain"))
        assert random.getstate() == drawn  # both seeded alike: the tracker drew nothing
        rng = [load(tmp_path / d / "checkpoints" / "last.pt")["rng"] for d in ("run", "plain")]
        assert same(*rng, "rng") is None


@pytest.mark.slow
def test_after_a_stop_signal_a_hanging_server_holds_the_exit_only_within_the_launchers_grace(
    tmp_path, caplog, monkeypatch
):
    """A preempted job has its launcher's grace to exit (8 s here) before the launcher SIGKILLs it; a tracking
    server that hangs held the exit for all of mlflow.close_timeout_s (30 s). Its checkpoint comes first."""
    import time

    from ddplab.runtime import env
    from ddplab.runtime.signals import Preempted

    monkeypatch.setattr(env, "launcher_grace_s", lambda: 8.0)
    args = BASE + [
        f"mlflow.tracking_uri=http://127.0.0.1:{hanging_server()}",
        "mlflow.close_timeout_s=30",
        "+callbacks.sig._target_=toy_callbacks.SignalAtStep",
        "+callbacks.sig.sig=SIGTERM",
        "+callbacks.sig.step=3",
    ]
    t0 = time.monotonic()
    with pytest.raises(Preempted):
        ddplab.run(compose_cfg(args, tmp_path / "run"))
    assert time.monotonic() - t0 < 8.0  # the signal came ~1 s in; 30 s before the fix
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "preempted"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mlflow: ")]
    assert len(said) == 1 and "did not take the run's last" in said[0], said


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_the_default_store_is_mlflows_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow's local stores keep artifacts under ./mlruns
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'local.db'}")
    ddplab.run(
        compose_cfg(
            BASE[:-2] + ["num_epochs=1", "limit_train_steps=2", "logger=[tensorboard,mlflow]"],
            tmp_path / "run",
        )
    )
    client, run = run_of(tmp_path / "run", f"sqlite:///{tmp_path / 'local.db'}")
    assert run.info.status == "FINISHED" and "val/loss" in run.data.metrics
    # its artifacts: here
    assert [p.name for p in (tmp_path / "mlruns").iterdir()] == [run.info.experiment_id]


@pytest.mark.slow
def test_a_study_is_one_experiment_with_a_run_per_trial_holding_its_params(tmp_path, mlflow_server):
    from helpers.study import load, study_args

    d = tmp_path / "study"
    assert_ok(
        run_cmd(
            [
                sys.executable,
                str(REPO / "train.py"),
                *study_args(d, 2),
                "logger=[tensorboard,mlflow]",
                f"mlflow.tracking_uri={mlflow_server}",
            ],
            tmp_path,
        )
    )
    client, study = MlflowClient(mlflow_server), load(d)
    runs = client.search_runs([client.get_experiment_by_name("study digits_lr_wd").experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    by_dir = {r.data.tags["ddplab.run_dir"]: r for r in runs}
    for t in study.trials:
        run = by_dir[t.user_attrs["ddplab:dir"]]
        assert {k: float(run.data.params[k]) for k in t.params} == t.params
        assert run.data.metrics["val/acc"] == pytest.approx(t.value, rel=1e-6)  # the study objective


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_with_async_saves_log_the_finished_checkpoints_model_once(
    tmp_path, mlflow_server, strategy
):
    """DDP or FSDP on 2 ranks, checkpoints written in the background: rank 0 alone logs, and the model
    artifact is the last checkpoint's (the background write is on disk before the artifact is made). FSDP's
    checkpoint is sharded, every rank writing its part: the artifact is the whole model its shards hold."""
    from helpers.jobs import torchrun
    from safetensors.torch import load_file

    from ddplab.checkpoint.export import export

    run_dir = tmp_path / "run"
    assert_ok(
        torchrun(
            2,
            BASE
            + [
                f"mlflow.tracking_uri={mlflow_server}",
                "checkpoint.async_save=true",
                "checkpoint.every_n_steps=3",
                f"distributed={strategy}",
                f"hydra.run.dir={run_dir}",
            ],
            tmp_path,
            timeout=240,
        )
    )
    client, run = run_of(run_dir, mlflow_server)
    assert len(client.search_runs([run.info.experiment_id], f"tags.`ddplab.run_dir` = '{run_dir}'")) == 1
    got = load_file(client.download_artifacts(run.info.run_id, "model/model.safetensors", str(tmp_path)))
    want = load_file(export(run_dir, "safetensors", tmp_path / "want")[0] / "model.safetensors")
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
    assert [s for s, _ in history(client, run, "train/loss")] == [
        s for s, _ in read_scalars(run_dir / "tb")["train/loss"]
    ]


@pytest.mark.slow  # a fresh interpreter that imports MLflow: seconds
def test_mlflow_is_imported_with_its_usage_telemetry_off(tmp_path):
    """Outside CI (a user's run: no CI variable, no pytest) MLflow's telemetry starts a thread at import that
    fetches its config from the internet and then writes os.environ, racing the requests ddplab's writer
    thread sends: a KeyError ('_MLFLOW_TELEMETRY_SESSION_ID') ended MLflow logging for the soak's trial
    1864753826. The writer sets MLFLOW_DISABLE_TELEMETRY=true before MLflow is imported, where the user has
    not set it."""
    from mlflow.telemetry import utils  # the variables that count as CI for MLflow, read from its own code

    ci_like = {
        "CI",
        "PYTEST_CURRENT_TEST",
        "GITHUB_ACTIONS",
        "GITLAB_CI",
        "JENKINS_URL",
        "BUILDKITE",
        "TF_BUILD",
        "TRAVIS",
        "CIRCLECI",
        "TEAMCITY_VERSION",
        "CODEBUILD_BUILD_ARN",
        "BITBUCKET_BUILD_NUMBER",
        "CLOUD_RUN_EXECUTION",
        "RUNBOT_HOST_URL",
        "RUNBOT_BUILD_NAME",
        "RUNBOT_WORKER_ID",
        "MLFLOW_DISABLE_TELEMETRY",
        "DO_NOT_TRACK",
    }
    assert "PYTEST_CURRENT_TEST" in __import__("inspect").getsource(utils._is_ci_env_or_testing)
    probe = (
        "import os, threading\n"
        f"for k in {sorted(ci_like)!r}: os.environ.pop(k, None)\n"
        "from ddplab.tracking_setup import mlflow_environment\n"
        "mlflow_environment()\n"
        "import mlflow\n"
        "from mlflow.telemetry.utils import is_telemetry_disabled\n"
        "print(is_telemetry_disabled(), os.environ['MLFLOW_DISABLE_TELEMETRY'],\n"
        "      sorted(t.name for t in threading.enumerate() if 'Telemetry' in t.name))\n"
    )
    proc = run_cmd([sys.executable, "-c", probe], tmp_path, timeout=120)
    assert_ok(proc)
    assert proc.stdout.split("\n")[-2] == "True true []", proc.stdout
