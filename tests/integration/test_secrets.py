"""Secrets stay out of what real jobs write and say (issue 45): a password in a tracking URI, and a config key
named in ``redact_keys``, appear in no file of the run dir (checkpoints, TensorBoard, Hydra's copies,
provenance, mlflow.json, the exported model artifact), nothing the MLflow server stored (params, tags,
artifacts) and no console line, whether the server is up or down, in a sweep and under verify_resume; a
submitit sweep that would pickle one is refused. The job itself uses the real values (the callback checks its
token, MLflow gets the run)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from helpers.extras import needs
from helpers.jobs import assert_ok, python_train

needs("mlflow", "mlflow")

PASSWORD, TOKEN = "S3cretPw9", "T0kenXyz7"
ARGS = [
    "model=mlp",
    "num_epochs=1",
    "limit_train_steps=4",
    "log_every_n_steps=2",
    "progress=log",
    "logger=[tensorboard,mlflow]",
    "+callbacks.up._target_=toy_callbacks.Uploader",
    f"+callbacks.up.token={TOKEN}",
    "redact_keys=[callbacks.up.token]",
]


def holding(folder: Path, *secrets: str) -> list[str]:
    """Every file under ``folder`` whose bytes hold one of ``secrets``."""
    return [
        str(p)
        for p in folder.rglob("*")
        if p.is_file() and any(s.encode() in p.read_bytes() for s in secrets)
    ]


def with_password(uri: str) -> str:
    return uri.replace("http://", f"http://alice:{PASSWORD}@")


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_password_in_the_tracking_uri_and_a_redacted_key_are_written_and_said_nowhere(
    tmp_path, mlflow_server
):
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    proc = python_train(
        ARGS + [f"mlflow.tracking_uri={with_password(mlflow_server)}", f"hydra.run.dir={run}"],
        tmp_path,
        timeout=180,
    )
    assert_ok(proc)
    assert (run / ".hydra" / "overrides.yaml").is_file() and (run / "checkpoints" / "last.pt").is_file()
    assert holding(run, PASSWORD, TOKEN) == []
    assert holding(mlflow_server.folder, PASSWORD, TOKEN) == []
    out = proc.stdout + proc.stderr
    assert PASSWORD not in out and TOKEN not in out
    # ... and yet the job used them: its MLflow run holds the masked values and the model artifact.
    run_id = __import__("json").loads((run / "mlflow.json").read_text())["run_id"]
    got = MlflowClient(mlflow_server).get_run(run_id).data
    assert got.params["mlflow.tracking_uri"] == with_password(mlflow_server).replace(
        f"alice:{PASSWORD}", "***"
    )
    assert got.params["callbacks.up.token"] == "***" and "ddplab.model" in got.tags
    assert "***@" in (run / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_server_that_is_down_is_said_without_the_password(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    proc = python_train(
        ARGS
        + [
            f"mlflow.tracking_uri=http://alice:{PASSWORD}@127.0.0.1:{port}",
            "mlflow.log_model=false",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
        timeout=180,
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    said = [ln for ln in out.splitlines() if "mlflow: cannot reach" in ln]
    assert len(said) == 1 and f"http://***@127.0.0.1:{port}" in said[0], out[-3000:]
    # urllib3's retries of MLflow's calls: ddplab's one line says it
    assert "Retrying" not in out, out[-3000:]
    assert PASSWORD not in out and TOKEN not in out and holding(run, PASSWORD, TOKEN) == []


@pytest.mark.slow  # a sweep of two jobs in one process
def test_a_sweep_writes_and_says_the_secrets_nowhere(tmp_path):
    """A sweep's job gets its overrides with Hydra's escapes (``http\\://alice\\:pw@h``), which the masking
    did not read as a URI: the password sat in each job's .hydra/ copies, train.log, TensorBoard dir name (the
    override counted as swept), the sweep's summary and Hydra's console line of each job it launched."""
    sweep = tmp_path / "sweep"
    proc = python_train(
        [
            "-m",
            *ARGS,
            "seed=1,2",
            f"mlflow.tracking_uri=http://alice:{PASSWORD}@127.0.0.1:9",
            "mlflow.log_model=false",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
        timeout=240,
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert PASSWORD not in out and TOKEN not in out and holding(tmp_path, PASSWORD, TOKEN) == []
    assert sorted(p.name for p in (sweep / "0").iterdir() if p.is_dir()) == [
        ".hydra",
        "checkpoints",
        "seed=1",
    ]
    assert "mlflow.tracking_uri=http\\://***@127.0.0.1\\:9" in (sweep / "summary.md").read_text()


@pytest.mark.slow  # mode=verify_resume: three runs, each a process
def test_verify_resume_hands_its_runs_their_config_without_writing_the_secrets(tmp_path):
    """verify_resume started each run from a JSON file of the whole config in its run dir: the password and
    the redacted key stayed there, unmasked, after the job (the runs need the real values: they get them on a
    pipe)."""
    run = tmp_path / "run"
    proc = python_train(
        ARGS
        + [
            "mode=verify_resume",
            f"mlflow.tracking_uri=http://alice:{PASSWORD}@127.0.0.1:9",
            "mlflow.log_model=false",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
        timeout=240,
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "verify_resume: PASS" in out, out[-3000:]
    assert sorted(p.name for p in (run / "verify_resume").iterdir() if p.is_dir()) == [
        "resumed",
        "uninterrupted",
    ]
    assert PASSWORD not in out and TOKEN not in out and holding(run, PASSWORD, TOKEN) == []


@pytest.mark.slow  # a process
def test_a_submitit_sweep_refuses_a_secret_it_would_pickle_unmasked(tmp_path):
    """submitit pickles the whole config and the jobs' overrides into <sweep dir>/.submitit/ for its jobs to
    load: the password sat there unmasked (the .hydra copies were masked). Refused in one line before a file
    is written."""
    sweep = tmp_path / "sweep"
    proc = python_train(
        [
            "-m",
            "hydra/launcher=submitit_local",
            *ARGS[:5],
            "seed=1,2",
            f"hydra.sweep.dir={sweep}",
            f"mlflow.tracking_uri=http://alice:{PASSWORD}@127.0.0.1:9",
        ],
        tmp_path,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert [ln for ln in out.splitlines() if ln.strip()] == [
        "config error: mlflow.tracking_uri holds a secret, and submitit (LocalLauncher) would write it "
        "unmasked into "
        f"{sweep}/.submitit/. Fix: keep it in the environment: a tracking URI's user and password as "
        "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD, a PostgreSQL storage's as PGPASSWORD, any other "
        "value as "
        "${oc.env:YOUR_VARIABLE}"
    ]
    assert PASSWORD not in out and holding(tmp_path, PASSWORD) == [] and not sweep.exists()
