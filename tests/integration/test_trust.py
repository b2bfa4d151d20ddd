"""A run dir or checkpoint from elsewhere runs nothing (issue 45): ``export`` and ``mode=eval`` build only
what ddplab ships, torch.optim's classes or what the command names from the checkpoint's stored config; any
other ``_target_`` is refused in one line before it is imported, unless the user passes the trust switch."""

from __future__ import annotations

import pytest
from helpers.jobs import python_train
from helpers.trust import crafted, payloads, ran


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
