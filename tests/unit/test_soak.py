"""The fault soak (scripts/soak.py): its fixed pairwise plan holds every pair of dimension values (launcher,
world size 1-3, strategy, data source (digits, token files, Hugging Face JSONL through a BPE) and access (held
or streamed), checkpoint mode, signal, target, phase, step time, grad accumulation, run mode, one feature in
play: EMA, amp, loader workers or training by steps) in at least one trial — each trial faulted once, resumed
until the job completes and checked against its uninterrupted run. CI runs one of its ``CI_PARTS`` parts a
commit (four consecutive parts hold every value of every dimension; the parts together, every pair): the whole
plan is about 12 minutes of CI's 2 cores, a part 2-3 trials. The plan's generator is checked without running
anything; the whole plan, seed-drawn and long soaks run by hand."""

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
