"""The matrix's cells no other process test reached (MATRIX, tests/unit/test_failure_entries.py): a rank's
exception in a study trial and in a verify_resume leg ends as ddplab.failure says — one line, its exit code, a
whole result.json."""

from __future__ import annotations

import json
import re

import pytest
from helpers.jobs import python_train
from helpers.study import study_args
from helpers.zygote_cases import CASES

FAILS = CASES["a callback's exception"]  # rank 0's callback raises at step 2 (the job server's case)
BUG = "RuntimeError: FailsOnRank: a callback's own bug on rank 0 at step 2"


def errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if " ERROR: " in line]


@pytest.mark.slow
def test_a_trial_whose_job_fails_is_told_fail_with_its_record_and_one_line(tmp_path):
    """The trial's job raises (a user's callback): the study is told FAIL with the job's record as the reason,
    the trial's result.json is whole, its error is said once (by the job), and the worker goes on."""
    d = tmp_path / "s"
    proc = python_train(study_args(d, 1, *FAILS[4:]), tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]  # the study goes on (and ends: its one trial is told)
    result = json.loads((d / "0" / "result.json").read_text())
    assert set(result) == {"status", "error", "trial"} and result["status"] == "failed", result
    assert result["trial"]["state"] == "FAIL" and BUG in result["error"], result
    said = [line for line in errors(out) if BUG in line]
    assert len(said) == 1, errors(out)  # the job's line; the worker's says where to read it, not again
    assert re.search(r"trial 0 failed \(its error is above", out), out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.slow
def test_a_verify_leg_that_fails_is_one_line_and_its_record(tmp_path):
    """verify_resume's first leg raises: the verdict is no FAIL but that failure, in one line with exit 1; the
    leg's result.json records the error; the leg's traceback is in its log, not on the console."""
    run = tmp_path / "v"
    proc = python_train(["mode=verify_resume", *FAILS, f"hydra.run.dir={run}"], tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    [said] = errors(out)
    assert re.search(
        r"ERROR: verify_resume: the uninterrupted run failed \(exit 1, rank 0/1 failed .*" + re.escape(BUG),
        said,
    ), said
    legs = sorted((run / "verify_resume").glob("*/result.json"))
    assert len(legs) == 1, legs  # the resumed leg never started
    result = json.loads(legs[0].read_text())
    assert set(result) == {"status", "error"} and result["status"] == "failed" and BUG in result["error"], (
        result
    )
    assert "Traceback" not in out and "Traceback" in legs[0].parent.with_suffix(".log").read_text()
