"""The entry × failure kind matrix is whole: MATRIX names, for every cell, the process test that checks it
ends as ddplab.failure says (its exit code, one line, a whole result.json), and each named test exists.

A dead peer is named by the launcher's race as much as by ddplab (torchrun's agent and the self-launch's
SIGTERM the survivors at once; whether a survivor sees the lost connection or the signal first varies): its
cells are the soak's, whose invariants hold for either end (nothing lost, a whole result.json)."""

from __future__ import annotations

import ast
from pathlib import Path

MATRIX = {
    ("python", "config error"): [
        "integration/test_zygote.py::test_a_forked_job_ends_as_the_same_job_in_a_fresh_interpreter",
        "integration/test_config_errors.py::test_in_one_process_nccl_is_refused_not_ignored",
    ],
    ("python", "a rank's exception"): [
        "integration/test_zygote.py::test_a_forked_job_ends_as_the_same_job_in_a_fresh_interpreter"
    ],
    ("python", "a dead peer"): [],  # one process has no peer
    ("python", "a signal"): [
        "integration/test_preemption.py::test_sigint_stops_a_single_process_with_a_checkpoint_and_exit_code_130",
        "integration/test_zygote.py::test_a_forked_job_ends_as_the_same_job_in_a_fresh_interpreter",
    ],
    ("torchrun", "config error"): ["integration/test_config_errors.py::test_under_torchrun"],
    ("torchrun", "a rank's exception"): [
        "integration/test_errors_said_once.py::test_a_rank_that_fails_alone_is_the_error_result_json_records_not_its_peers_lost_connection"
    ],
    ("torchrun", "a dead peer"): [
        "integration/test_soak.py::test_the_pairwise_soak_plan_holds_every_invariant"
    ],
    ("torchrun", "a signal"): [
        "integration/test_preemption.py::test_sigterm_to_torchrun_checkpoints_every_rank_at_one_step_and_resume_is_bitwise"
    ],
    ("self-launch", "config error"): [
        "integration/test_config_errors.py::test_self_launched_ranks_report_a_build_time_error_once"
    ],
    ("self-launch", "a rank's exception"): [
        "integration/test_errors_said_once.py::test_a_self_launched_rank_that_fails_alone_is_said_once_by_the_parent_without_its_traceback"
    ],
    ("self-launch", "a dead peer"): [
        "integration/test_soak.py::test_the_pairwise_soak_plan_holds_every_invariant"
    ],
    ("self-launch", "a signal"): [
        "integration/test_preemption.py::test_self_launched_job_listens_on_loopback_only_and_stops_on_sigterm"
    ],
    ("study trial", "config error"): [
        "integration/test_study_storages_and_input.py::test_bad_input_is_one_line_within_seconds"
    ],
    ("study trial", "a rank's exception"): [
        "integration/test_failure_entries.py::test_a_trial_whose_job_fails_is_told_fail_with_its_record_and_one_line"
    ],
    ("study trial", "a dead peer"): [
        "integration/test_study_owners.py::test_a_rank_killed_under_a_torchrun_worker_is_a_death_not_a_failed_trial"
    ],
    ("study trial", "a signal"): [
        "integration/test_study.py::test_a_signal_as_a_trial_completes_ends_the_worker_after_telling_it"
    ],
    ("verify", "config error"): [
        "integration/test_verify_resume.py::test_a_stream_shuffled_per_rank_is_refused_in_one_line"
    ],
    ("verify", "a rank's exception"): [
        "integration/test_failure_entries.py::test_a_verify_leg_that_fails_is_one_line_and_its_record"
    ],
    ("verify", "a dead peer"): [
        "integration/test_soak.py::test_the_pairwise_soak_plan_holds_every_invariant"
    ],
    ("verify", "a signal"): [
        "integration/test_verify_resume.py::test_a_leg_stopped_from_outside_is_a_preemption_not_a_verdict"
    ],
}


TESTS = Path(__file__).resolve().parents[1]

ENTRIES = ("python", "torchrun", "self-launch", "study trial", "verify")
KINDS = ("config error", "a rank's exception", "a dead peer", "a signal")


def test_every_entry_and_failure_kind_has_its_test():
    assert set(MATRIX) == {(e, k) for e in ENTRIES for k in KINDS}
    assert [cell for cell, named in MATRIX.items() if not named] == [("python", "a dead peer")]
    for cell, named in MATRIX.items():
        for name in named:
            file, test = name.split("::")
            defined = {
                n.name
                for n in ast.walk(ast.parse((TESTS / file).read_text()))
                if isinstance(n, ast.FunctionDef)
            }
            assert test in defined, f"{cell}: {name} does not exist"
