"""docs/reference.md is the render of the schema and every option of conf/ today
(scripts/config_reference.py): it is current, it names every key, group option and default with a meaning, and
``--check`` fails on a stale page, so the documentation cannot drift from the code."""

from __future__ import annotations

import dataclasses
import functools
import re
import sys

import pytest
from helpers.jobs import CONF, REPO

sys.path.insert(0, str(REPO / "scripts"))
import config_reference  # noqa: E402  (scripts/config_reference.py)

from ddplab.config import schema  # noqa: E402
from ddplab.config.groups import GROUPS  # noqa: E402

# composes every option of conf/ (seconds): once a session
rendered = functools.cache(config_reference.render)
# both tests on one worker: they share that one render
pytestmark = pytest.mark.xdist_group("config_reference")


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_the_reference_page_is_what_the_schema_and_conf_say_today():
    text = rendered()
    assert (REPO / "docs" / "reference.md").read_text() == text, "Fix: python scripts/config_reference.py"
    keys = set(re.findall(r"^\| `([\w.]+)` \|", text, re.M))
    for f in dataclasses.fields(schema.TrainConfig):  # every top-level key and every key of a sub-config
        if (
            dataclasses.is_dataclass(f.default_factory())
            if f.default_factory is not dataclasses.MISSING
            else False
        ):
            sub = f.default_factory()
            assert {f"{f.name}.{g.name}" for g in dataclasses.fields(sub)} <= keys, f.name
        elif f.name not in config_reference.GROUPS:
            assert f.name in keys, f.name
    # every option of conf/
    for group in config_reference.GROUPS + config_reference.PRESETS + ("distributed",):
        for path in (CONF / group).glob("*.yaml"):
            assert (
                f"`{group}={path.stem}`" in text
                or f"`callbacks=[{path.stem}]`" in text
                or f"| `{path.stem}` |" in text
            ), (group, path.stem)
    assert set(GROUPS) >= {"model", "dataset", "optimizer", "scheduler", "task", "callbacks"}
    # Every key its own meaning (give the schema field a comment of its own), every option its description.
    assert config_reference.unmeant(text) == [], config_reference.unmeant(text)
    assert "\n(conf/" not in text, "an option's yaml without its opening comment"


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_the_check_mode_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "reference.md"
    stale.write_text("# stale\n")
    monkeypatch.setattr(config_reference, "OUT", stale)
    monkeypatch.setattr(config_reference, "REPO", tmp_path)
    monkeypatch.setattr(config_reference, "render", rendered)
    assert config_reference.main(["--check"]) == 1
    assert "reference.md is out of date. Fix: python scripts/config_reference.py" in capsys.readouterr().err
