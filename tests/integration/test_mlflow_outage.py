"""An MLflow outage longer than MLflow's own retries loses nothing (issue 47, item 5). Before, the first
failed send ended MLflow logging for the run: a run FINISHED with steps missing. Now what MLflow misses is
sent when the server is back (in the run), what it still lacks at the end is said with the command that
sends it (``python -m ddplab sync``, from TensorBoard's record), and a resume sends what a stopped attempt
could not: each time every step of every scalar once, equal to TensorBoard's. The server is the session's,
behind a gate (helpers/gate.py) that the ``Outage`` callback shuts and opens at given steps. And an experiment
another job makes at the same moment loses no run (it lost the whole MLflow run before)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.extras import lazy
from helpers.gate import Gate
from helpers.jobs import compose_cfg

import ddplab
from ddplab import sync
from ddplab.events import read_scalars
from ddplab.runtime.signals import Preempted

tracking = lazy("mlflow.tracking", "mlflow")
GATE: Gate | None = None  # this test's gate: the Outage callback's
HERE = "integration.test_mlflow_outage"


class Outage:
    """Shuts the gate after step ``shut_at`` and opens it after ``open_at`` (0: never). Each time the loop is
    held until MLflow's writer has met the change (a text it is handed at the shut fails to go; the backlog
    goes at the open), whatever the machine's load."""

    def __init__(self, shut_at: int, open_at: int = 0):
        self.shut_at, self.open_at = shut_at, open_at

    def on_step_end(self, state, step):
        writer = next(w for w in state.writer.writers if hasattr(w, "retry_s"))  # TeeWriter's MLflow one
        if step == self.shut_at:
            until(lambda: (state.run_dir / "mlflow.json").exists())  # the MLflow run is made
            GATE.shut()
            writer.text("outage", f"the gate shut after step {step}")
            until(lambda: writer.down)
        if step == self.open_at:
            GATE.open()
            until(lambda: not writer.down)


def until(done, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "MLflow's writer did not meet the gate's change"
        time.sleep(0.05)


@pytest.fixture
def gate(mlflow_server, monkeypatch):
    global GATE
    # each request tried once, briefly: the outage is longer than MLflow's retries
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    GATE = Gate(int(mlflow_server.rsplit(":", 1)[1]))
    yield GATE
    GATE.shut()
    GATE = None


def args(gate: Gate, shut_at: int, open_at: int = 0) -> list[str]:
    return [
        *("model=mlp", "progress=none", "num_epochs=2", "limit_train_steps=6", "log_every_n_steps=1"),
        *("logger=[tensorboard,mlflow]", f"mlflow.tracking_uri={gate.uri}", "mlflow.retry_s=0.5"),
        f"+callbacks.outage._target_={HERE}.Outage",
        f"+callbacks.outage.shut_at={shut_at}",
        f"+callbacks.outage.open_at={open_at}",
    ]


def assert_mlflow_holds_tensorboards_record(run_dir: Path, uri: str, status: str = "FINISHED") -> None:
    client = tracking.MlflowClient(uri)
    run = client.get_run(json.loads((run_dir / "mlflow.json").read_text())["run_id"])
    tb = read_scalars(run_dir / "tb")
    assert run.info.status == status and set(run.data.metrics) == set(tb) and "train/loss" in tb
    for key, points in tb.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert [s for s, _ in got] == [s for s, _ in points], key  # every step, each once
        assert [np.float32(v) for _, v in got] == [np.float32(v) for _, v in points], key


def mlflow_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("mlflow: ")]


@pytest.mark.slow
def test_an_outage_in_the_run_is_sent_when_the_server_is_back(tmp_path, gate, caplog):
    run = tmp_path / "run"
    out = ddplab.run(compose_cfg(args(gate, shut_at=3, open_at=8), run))
    assert out["step"] == 12
    said = mlflow_lines(caplog)
    assert [s.split(" (")[0] for s in said if "cannot reach" in s] == [f"mlflow: cannot reach {gate.uri}"]
    assert not [s for s in said if "did not take" in s], said
    assert_mlflow_holds_tensorboards_record(run, gate.uri)


@pytest.mark.slow
def test_an_outage_at_the_end_is_said_with_the_command_that_sends_it_later(tmp_path, gate, caplog):
    run = tmp_path / "run"
    ddplab.run(compose_cfg(args(gate, shut_at=9) + ["mlflow.close_timeout_s=5"], run))
    said = [s for s in mlflow_lines(caplog) if "did not take" in s]
    assert len(said) == 1 and said[0].endswith(f"python -m ddplab sync {run} sends them, each step once")
    gate.open()
    assert sync.main([str(run), "--tracking-uri", gate.uri]) == 0
    assert_mlflow_holds_tensorboards_record(run, gate.uri)


@pytest.mark.slow
def test_a_resume_sends_what_a_stopped_attempt_could_not(tmp_path, gate, caplog):
    run = tmp_path / "run"
    stop = ["+callbacks.sig._target_=toy_callbacks.SignalAtStep", "+callbacks.sig.sig=SIGTERM"]
    with pytest.raises(Preempted):
        ddplab.run(compose_cfg(args(gate, shut_at=4) + stop + ["+callbacks.sig.step=8"], run))
    gate.open()
    ddplab.run(compose_cfg(args(gate, shut_at=0) + ["resume=auto"], run))
    assert_mlflow_holds_tensorboards_record(run, gate.uri)


@pytest.mark.slow
def test_a_server_down_from_the_start_gets_the_whole_run_from_sync(tmp_path, gate, caplog):
    run = tmp_path / "run"
    gate.shut()
    ddplab.run(compose_cfg(args(gate, shut_at=0) + ["mlflow.close_timeout_s=5"], run))
    assert not (run / "mlflow.json").exists()  # the MLflow run was never made
    gate.open()
    assert sync.main([str(run)]) == 0  # the URI and experiment from the run's config
    assert_mlflow_holds_tensorboards_record(run, gate.uri)


def test_an_experiment_another_job_makes_at_the_same_moment_is_no_failure(tmp_path, mlflow_server, caplog):
    """Two jobs of a sweep (or two tests) both found no experiment and both made it: the second got
    RESOURCE_ALREADY_EXISTS, and its whole MLflow run was lost. Here the other job's experiment is made
    between this writer's look and its make."""
    from ddplab.tracking import MLflowWriter

    name = f"race {tmp_path.name}"
    client = tracking.MlflowClient(mlflow_server)
    looked = []

    def look(self, experiment):  # the writer's first look finds nothing; the other job makes it just then
        if not looked:
            looked.append(experiment)
            client.create_experiment(experiment)
            return None
        return real(self, experiment)

    real = tracking.MlflowClient.get_experiment_by_name
    tracking.MlflowClient.get_experiment_by_name = look
    try:
        writer = MLflowWriter(mlflow_server, name, tmp_path, 30.0)
        writer.scalars({"train/loss": 1.5}, 1)
        writer.close()
    finally:
        tracking.MlflowClient.get_experiment_by_name = real
    assert looked == [name] and not [r for r in caplog.records if r.getMessage().startswith("mlflow: ")]
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert [r.data.metrics for r in runs] == [{"train/loss": 1.5}] and runs[0].info.status == "FINISHED"
