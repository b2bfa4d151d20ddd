"""logger=[tensorboard,mlflow] (issue 34, item 4), against a real `mlflow server` on loopback with a SQLite
backend started here: the same scalars as TensorBoard, config as params, tags; one MLflow run per job and per
sweep job, grouped by the sweep; a resume continues the same run with each step once; a server that is down
or hangs never stops training and is said once."""

from __future__ import annotations

import sys

import pytest
from helpers.jobs import compose_cfg

import ddplab
from ddplab.config.errors import ConfigError


@pytest.mark.parametrize(
    "override, said",
    [
        (
            "logger=[mlflow]",
            r"logger=\['mlflow'\]: one or more of tensorboard, mlflow, tensorboard among them",
        ),
        ("mlflow.close_timeout_s=0", r"mlflow.close_timeout_s=0.0: must be > 0"),
    ],
)
def test_logger_config_errors_are_one_line(tmp_path, override, said):
    with pytest.raises(ConfigError, match=said):
        ddplab.run(compose_cfg(["model=mlp", override], tmp_path / "run"))


def test_without_the_extra_mlflow_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    # refused by the config's check, on every rank, before any process group
    # (tests/integration/test_config_errors.py)
    with pytest.raises(
        ConfigError,
        match=r"^logger=\['tensorboard', 'mlflow'\]: needs MLflow, which is not installed. "
        r"Fix: pip install 'ddplab\[mlflow\]', or logger=\[tensorboard\]$",
    ):
        ddplab.run(
            compose_cfg(["model=mlp", "logger=[tensorboard,mlflow]", "num_epochs=1"], tmp_path / "run")
        )
