"""The fault soak's driver (scripts/soak.py), in-process: ``--minutes`` bounds only a run of trials drawn at
random; the pairwise plan and ``--only`` run whole and refuse it in one line (the plan, its parts and its
trials: tests/integration/test_soak.py)."""

from __future__ import annotations

import sys

import pytest
from helpers.jobs import REPO

sys.path.insert(0, str(REPO / "scripts"))
import soak  # noqa: E402  (scripts/soak.py, the driver)


def test_minutes_bound_only_a_run_drawn_at_random(capsys):
    for plan in (["--pairwise"], ["--only", "5"]):
        with pytest.raises(SystemExit) as e:
            soak.main([*plan, "--minutes", "10"])
        assert (
            e.value.code == 2
            and "the pairwise plan and --only run whole: drop --minutes" in capsys.readouterr().err
        )
