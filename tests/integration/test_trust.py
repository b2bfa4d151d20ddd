"""A crafted checkpoint from elsewhere runs nothing (issue 45): ``export`` and ``mode=eval`` (in-process and
under train.py) build only what ddplab ships, torch.optim's classes or what the command names from the
checkpoint's stored config; any other ``_target_`` is refused in one line before it is imported, unless the
user passes the trust switch, which a user's own run needs to export its own model."""

from __future__ import annotations

import pytest
from helpers.jobs import compose_cfg, python_train
from helpers.trust import TINY, crafted, payloads, ran

import ddplab
from ddplab.checkpoint import export
from ddplab.config import ConfigError


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_mode_eval_refusal_under_train_py_is_one_line_exit_2(tmp_path, trained):
    model, marker, how = payloads(tmp_path)["savetxt"]
    path = crafted(trained, tmp_path, model)
    proc = python_train(
        ["mode=eval", f"resume={path}", f"hydra.run.dir={tmp_path / 'eval'}"], tmp_path, timeout=120
    )
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "numpy.savetxt" in ln]
    assert proc.returncode == 2 and len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not ran(marker, how)


@pytest.mark.parametrize("name", ["savetxt", "pickle", "open", "nested", "alias"])
def test_export_of_a_crafted_checkpoint_runs_nothing_and_says_so_in_one_line(tmp_path, trained, capsys, name):
    model, marker, how = payloads(tmp_path)[name]
    path = crafted(trained, tmp_path, model)
    assert export.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "_target_=" in err and "Fix: " in err and "--trust-config" in err, (
        err
    )
    assert model["_target_"] in err or "write_tokens" in err
    assert not ran(marker, how) and not (path.parent.parent / "export").exists()


@pytest.mark.parametrize("name", ["pickle", "open", "nested"])
def test_mode_eval_of_a_crafted_checkpoint_runs_nothing(tmp_path, trained, name):
    model, marker, how = payloads(tmp_path)[name]
    path = crafted(trained, tmp_path, model)
    with pytest.raises(
        ConfigError,
        match=r"mode=eval resume=.*stored config names model.*Fix: .*"
        r"trust_stored_config=true",
    ):
        ddplab.run(compose_cfg(["mode=eval", f"resume={path}", "progress=none"], tmp_path / "eval"))
    assert not ran(marker, how)


def test_an_own_run_with_its_own_model_exports_with_the_switch(tmp_path):
    """A user's model class (tests/toy.py's) is refused from the stored config alone, and exported with it."""
    run = tmp_path / "run"
    ddplab.run(compose_cfg(TINY + ["model._target_=toy.FaultyMLP"], run))
    assert export.main([str(run)]) == 2
    assert export.main([str(run), "--trust-config", "--to", "state_dict"]) == 0
    assert (run / "export" / "model.pt").is_file()
