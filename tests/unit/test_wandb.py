"""logger=[tensorboard,wandb]'s choices and refusals (issue 47, item 4), in-process, without starting W&B: a
bad timeout or project, and wandb not installed, are each one config error; wandb.mode=auto goes online only
where W&B has a key (or WANDB_MODE says); a study's and a sweep's runs share a W&B group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.jobs import compose_cfg
from omegaconf import OmegaConf

import ddplab
from ddplab.config.errors import ConfigError
from ddplab.runtime import env
from ddplab.tracking_setup import group_name


@pytest.mark.parametrize(
    "override, said",
    [
        (
            "wandb.close_timeout_s=0",
            r"^wandb.close_timeout_s=0.0: must be > 0. Fix: pass wandb.close_timeout_s=30$",
        ),
        ("wandb.init_timeout_s=-1", r"^wandb.init_timeout_s=-1.0: must be > 0"),
        ("wandb.project=team/p", r"^wandb.project='team/p': must be a non-empty name without '/'"),
        ("wandb.mode=cloud", r"wandb.mode"),  # the typed choice: Hydra names the key and the options
    ],
)
def test_wandb_config_errors_are_one_line(tmp_path, override, said):
    with pytest.raises(Exception, match=said):
        ddplab.run(compose_cfg(["model=mlp", "logger=[tensorboard,wandb]", override], tmp_path / "run"))


def test_without_the_extra_wandb_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        ConfigError,
        match=r"^logger=\['tensorboard', 'wandb'\]: needs wandb, which is not installed. "
        r"Fix: pip install 'ddplab\[wandb\]', or logger=\[tensorboard\]$",
    ):
        ddplab.run(compose_cfg(["model=mlp", "logger=[tensorboard,wandb]", "num_epochs=1"], tmp_path / "run"))


@pytest.fixture
def no_key(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    return tmp_path / "netrc"


def test_auto_goes_online_only_where_wandb_has_a_key(no_key, monkeypatch):
    assert not env.wandb_online_possible()  # no key, no netrc file
    no_key.write_text("machine example.org login user password secret\n")
    assert not env.wandb_online_possible()  # another host's entry
    no_key.write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")  # `wandb login`'s
    assert env.wandb_online_possible()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")  # a server of one's own: its entry
    assert not env.wandb_online_possible()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert env.wandb_online_possible()
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "offline")  # the user's choice: W&B reads it itself
    assert env.wandb_online_possible()


def test_a_studys_and_a_sweeps_runs_share_a_group(tmp_path):
    def cfg(**over):
        base = {"wandb": {"group": None}, "callbacks": {}, "study": {"name": "lr_search"}}
        return OmegaConf.merge(base, over)

    run_dir = tmp_path / "multirun" / "2026-11-30" / "12-00-00" / "3"
    assert group_name(cfg(), Path("/tmp/run"), multirun=False) is None
    assert group_name(cfg(), run_dir, multirun=True) == "sweep 2026-11-30/12-00-00"
    assert group_name(cfg(callbacks={"study": {}}), run_dir, multirun=False) == "study lr_search"
    assert group_name(cfg(wandb={"group": "mine"}), run_dir, multirun=True) == "mine"
