"""A dataset under real ranks, as the stream and token-file tests run it (tests/integration/test_streams.py,
test_tokens.py): the same run at world sizes 1, 2 and 3; a 2-rank run whose rank 1 is SIGKILLed at step 13
(last checkpoint: step 10, mid-epoch), resumed from copies of its run dir at 2 and at 3 ranks; a job one
rank's error stopped."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from helpers.compare import result
from helpers.jobs import assert_ok, rank_kills_itself, ranks


def metrics_at_world_sizes(args: list[str], tmp_path: Path) -> dict[int, dict[str, Any]]:
    """``args`` run at 1, 2 and 3 ranks (run dirs ``tmp_path/1``, ``/2``, ``/3``): each run's metrics."""
    runs = {}
    for n in (1, 2, 3):
        assert_ok(ranks(n, args + [f"hydra.run.dir={tmp_path / str(n)}"], tmp_path, timeout=240))
        runs[n] = result(tmp_path / str(n))["metrics"]
    return runs


def rank_1_killed_at_step_13(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """``args`` (with the soak's injector, ``+callbacks.soak._target_=soak_toy.SoakCallback``) at 2 ranks in
    ``tmp_path/killed_then_2``, rank 1 SIGKILLing itself before step 13 (``tmp_path/fault/fired`` says
    where): the crashed job, for the caller's own checks of how it ended."""
    return ranks(
        2,
        args + [f"hydra.run.dir={tmp_path / 'killed_then_2'}"],
        tmp_path,
        timeout=240,
        extra_env=rank_kills_itself(tmp_path / "fault", rank=1, k=13),
    )


def resumed_at_2_and_3(args: list[str], tmp_path: Path) -> dict[int, Path]:
    """The crashed run dir copied, and each copy resumed at another world size (``resume=auto``) from the
    step-10 checkpoint: the resumed run dirs by world size."""
    shutil.copytree(tmp_path / "killed_then_2", tmp_path / "killed_then_3")
    resumed = {}
    for n in (2, 3):
        run = tmp_path / f"killed_then_{n}"
        assert_ok(ranks(n, args + [f"hydra.run.dir={run}", "resume=auto"], tmp_path, timeout=240))
        assert "0 epoch(s), 10 step(s) done" in (run / "train.log").read_text()
        resumed[n] = run
    return resumed


def assert_failed_saying(proc: subprocess.CompletedProcess, said: str, run: Path) -> None:
    """A job one rank's error stopped: it exited non-zero, its console matches ``said`` (a regex) and its
    result.json records the failure."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert re.search(said, out), out[-3000:]
    assert result(run)["status"] == "failed"
