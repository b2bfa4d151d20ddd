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
from soak_draw import draw, trial_seeds
from soak_plan import SLURM

sys.path.insert(0, str(REPO / "scripts"))
import soak  # noqa: E402  (scripts/soak.py, the driver)


def test_srun_is_drawn_as_a_launcher_only_with_slurm_and_never_for_what_it_cannot_run(capsys):
    seeds = trial_seeds(1127, 200)
    # without --slurm the draws are what they always were
    assert all(draw(s).launcher != SLURM for s in seeds)
    under = [t for t in (draw(s, slurm=True) for s in seeds) if t.launcher == SLURM]
    assert 30 <= len(under) <= 70, len(under)  # one launcher of four
    # verify_resume starts its own processes: not under srun
    assert {t.mode for t in under} == {"train", "study"}
    assert {t.strategy for t in under} == {"ddp", "fsdp"} and all(t.world == 2 for t in under)
    assert under[0].rerun() == f"python scripts/soak.py --only {under[0].seed} --slurm --keep"
    # the plan is fixed (CI runs it before its cluster is up): one line, exit 2
    with pytest.raises(SystemExit) as e:
        soak.main(["--pairwise", "--slurm"])
    assert e.value.code == 2 and "the --pairwise plan is fixed: drop one of them" in capsys.readouterr().err


def test_minutes_bound_only_a_run_drawn_at_random(capsys):
    for plan in (["--pairwise"], ["--only", "5"]):
        with pytest.raises(SystemExit) as e:
            soak.main([*plan, "--minutes", "10"])
        assert (
            e.value.code == 2
            and "the pairwise plan and --only run whole: drop --minutes" in capsys.readouterr().err
        )
