"""logger=[tensorboard,mlflow]'s refusals (issue 34, item 4), in-process, no server: a logger list without
tensorboard, a close_timeout_s that is not positive, and MLflow not installed are each one config error."""

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
            r"logger=\['mlflow'\]: one or more of tensorboard, mlflow, wandb, tensorboard among them",
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
