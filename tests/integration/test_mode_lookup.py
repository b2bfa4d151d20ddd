"""train.py skips Hydra's extra compose that only reads ``hydra.mode`` where nothing can set it
(``ddplab.cli.skip_needless_mode_lookup``): the shortcut's answer must be Hydra's own, for every option of
``conf/`` and for the overrides that can set the mode."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.jobs import CONF
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode

from ddplab.cli import mode_may_be_set

OPTIONS = sorted(f"{p.parent.name}={p.stem}" for p in CONF.glob("*/*.yaml"))


def hydras_answer(overrides: list[str]) -> RunMode | None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return GlobalHydra.instance().hydra.get_mode(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        *([o] for o in OPTIONS),
        ["+hparams_search=optuna"],
        ["hparams_search=study,optuna"],
        ["hydra.mode=MULTIRUN"],
        ["model=mlp", "hydra.mode=RUN"],
        ["model=mlp,convnet"],
        ["hydra.run.dir=x", "hydra.job.chdir=false", "hydra.output_subdir=null"],
        ["hydra/sweeper=optuna"],
        ["hydra/hydra_logging=disabled"],
    ],
)
def test_the_shortcut_skips_only_where_hydra_finds_the_mode_unset(overrides):
    found = hydras_answer(overrides)
    may = mode_may_be_set(CONF, overrides, ["train.py", *overrides])
    assert may or found is None, (overrides, found)
    if overrides == [] or overrides[0] in OPTIONS or overrides[0] == "hydra.run.dir=x":  # skipped wherever
        # Hydra finds the mode unset for a plain choice: the usual commands (and every test's run dir) save
        assert may == (found is not None), (overrides, found)


def test_another_config_dir_is_always_asked(tmp_path: Path):
    assert mode_may_be_set(CONF, [], ["train.py", "--config-dir", str(tmp_path)])
    assert mode_may_be_set(CONF, [], ["train.py", "-cn", "other"])
    assert hydras_answer(["hparams_search=optuna"]) == RunMode.MULTIRUN  # the one option here that sets it


def test_every_option_is_looked_at():
    assert len(OPTIONS) >= 40 and "hparams_search=optuna" in OPTIONS and "model=gpt" in OPTIONS
