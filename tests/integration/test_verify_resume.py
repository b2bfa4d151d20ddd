"""mode=verify_resume, run for real: the user's own job, run whole and run preempted + resumed in fresh
processes, the two ends compared. PASS on a shipped task (bitwise at the same world size, to a tolerance at
another) and on noise from torch's generator; FAIL naming the first differing entry and step, and the likely
cause, for a dataset with unseeded randomness and for one whose seeded generator restarts on resume; a leg
refused or stopped from outside, and what it cannot run, is one line and no verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.jobs import compose_cfg, python_train

from ddplab import verify
from ddplab.config.errors import ConfigError

SHORT = ["model=mlp", "num_epochs=2", "limit_train_steps=6", "progress=none"]  # 12 steps, 6 an epoch


def verdict(tmp_path: Path, args: list[str]) -> tuple[int, str, dict]:
    """Exit code, the verify_resume line, and verify_resume.json of one ``python train.py
    mode=verify_resume``."""
    proc = python_train(["mode=verify_resume", *SHORT, *args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    lines = [
        ln
        for ln in (proc.stdout + proc.stderr).splitlines()
        if "verify_resume: " in ln and ("PASS" in ln or "FAIL" in ln or "failed" in ln)
    ]
    report = tmp_path / "run" / "verify_resume" / "verify_resume.json"
    return (
        proc.returncode,
        lines[-1] if lines else proc.stderr[-3000:],
        (json.loads(report.read_text()) if report.exists() else {}),
    )


def python_lines(tmp_path: Path) -> list[str]:
    """The console lines of the last :func:`verdict` (its train.log: what rank 0 said)."""
    return (tmp_path / "run" / "train.log").read_text().splitlines()


# --------------------------------------------------------------------------- real runs
@pytest.mark.slow
def test_a_shipped_task_passes_bitwise_with_every_entry_compared(tmp_path):
    code, line, report = verdict(tmp_path, [])
    assert (
        code == 0
        and "verify_resume: PASS: 1 rank(s), stopped at step 3 of 12, resumed: every checkpoint entry "
        in line
    )
    assert "(model, optimizer, scheduler, scaler, loop, rng, results)" in line and "bit-identical" in line
    assert report["passed"] and (report["stop_signalled_at"], report["total_steps"]) == (3, 12)
    first_leg = (tmp_path / "run" / "verify_resume" / "resumed.log").read_text()
    # stopped mid-epoch, resumed there
    assert "preempted" in first_leg and "0 epoch(s), 3 step(s) done" in first_leg


@pytest.mark.slow
def test_unseeded_randomness_in_a_users_dataset_is_named(tmp_path):
    code, line, report = verdict(tmp_path, ["dataset._target_=toy.noisy_digits"])
    assert (
        code == 1
        and "FAIL (1 rank(s), stopped at step 3 of 12)" in line
        and "first differs at step 1" in line
    )
    assert "not reproducible even without a resume" in line and "np.random.default_rng()" in line
    assert report["first_step"] == 1 and report["first_entry"].startswith("model.")


@pytest.mark.slow
def test_a_seeded_generator_that_restarts_on_resume_is_named(tmp_path):
    code, line, report = verdict(tmp_path, ["dataset._target_=toy.noisy_digits", "+dataset.noise_seed=3"])
    assert code == 1 and "train/loss first differs at step 4" in line  # the first step after the resume
    assert "begins again from its seed" in line and report["cause"] == verify.RESTARTS_FROM_SEED


@pytest.mark.dist
def test_two_ranks_pass_bitwise_and_resumed_at_one_rank_pass_to_a_tolerance(tmp_path):
    for name in ("same", "other"):
        (tmp_path / name).mkdir()
    code, line, report = verdict(tmp_path / "same", ["distributed.nproc_per_node=2"])
    assert code == 0 and "bit-identical" in line and report["nproc"] == report["resume_nproc"] == 2, line
    assert "PASS: 2 rank(s), stopped at step" in line  # which world size the proof holds for
    # dropout off: its masks are drawn per rank, so another world size draws others (a different job, rightly)
    code, line, report = verdict(
        tmp_path / "other", ["distributed.nproc_per_node=2", "verify.resume_nproc=1", "model.dropout=0"]
    )
    assert code == 0 and "equal to rtol=0.0001 (another world size; RNG streams not compared)" in line, line
    assert (report["nproc"], report["resume_nproc"]) == (2, 1) and "2 rank(s), resumed at 1, stopped" in line


@pytest.mark.slow
def test_a_resumed_leg_refused_at_start_up_is_that_refusal_not_a_fail(tmp_path):
    """verify.resume_nproc=3 on a 2-core machine: the resumed leg is refused before it writes a result.json.
    verify read the first leg's stale one (preempted), compared, and blamed state outside the checkpoint."""
    import os

    more = len(os.sched_getaffinity(0)) + 1
    code, line, report = verdict(tmp_path, [f"verify.resume_nproc={more}"])
    assert code == 2 and report == {}, line
    said = [ln for ln in python_lines(tmp_path) if "error" in ln.lower()]
    assert len(said) == 1 and f"distributed.nproc_per_node={more}: this machine has" in said[0], said
    assert "the resumed run" in said[0] and "Fix: " in said[0], said


@pytest.mark.slow
def test_a_dataset_drawing_from_torchs_generator_passes(tmp_path):
    """What the docs tell users to do: noise from torch's generator, which ddplab seeds and checkpoints.
    ddplab's own bookkeeping (the FLOP count at the first log step, which a resumed run reaches at another
    step) draws nothing."""
    code, line, report = verdict(tmp_path, ["dataset._target_=toy.torch_noisy_digits"])
    assert (
        code == 0
        and "verify_resume: PASS: 1 rank(s), stopped at step 3 of 12" in line
        and "bit-identical" in line
    ), line


@pytest.mark.dist
def test_a_stream_shuffled_per_rank_is_refused_in_one_line(tmp_path):
    """Python's random, seeded per rank by ddplab, shuffling a stream: the ranks read different streams, which
    the uninterrupted run refuses at its first batch; verify_resume says so (exit 2), not a resume that
    differs."""
    proc = python_train(
        [
            "mode=verify_resume",
            *SHORT,
            "dataset._target_=toy.rank_dependent_stream",
            "+dataset.how=python_shuffle",
            "batch_size=48",
            "distributed.nproc_per_node=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
    )
    out = proc.stdout + proc.stderr
    said = [ln for ln in out.splitlines() if "config error: " in ln]
    assert proc.returncode == 2 and len(said) == 1 and "Traceback" not in out, out[-3000:]
    assert (
        "dataset._target_='toy.rank_dependent_stream': the training stream is not the same on every rank"
        in said[0]
    )


@pytest.mark.slow  # real processes: both legs and a signal
@pytest.mark.parametrize(
    "leg,sig", [("uninterrupted", "SIGTERM"), ("resumed", "SIGUSR1"), ("ctrl-c", "SIGINT")]
)
def test_a_leg_stopped_from_outside_is_a_preemption_not_a_verdict(tmp_path, leg, sig):
    """The cluster preempting a verify_resume job stops the leg running: the uninterrupted leg's result
    (``preempted``, no metrics) raised a KeyError with a traceback; the resumed leg's would have been compared
    as if it had finished, and the job blamed. It is a preemption: one line, exit 128 + the signal, no
    verdict."""
    import signal

    # the uninterrupted leg signals itself after step 2 (once: the marker); or the resumed leg, after step 11;
    # or Ctrl-C: the uninterrupted leg signals itself and verify_resume (the soak's seed 1126, trial
    # 1468072945: a KeyboardInterrupt traceback)
    marker, step = tmp_path / "fired", {"uninterrupted": 2, "resumed": 11, "ctrl-c": 2}[leg]
    target = {
        "uninterrupted": "study_toy.SignalOnce",
        "resumed": "toy_callbacks.SignalWhenResumed",
        "ctrl-c": "toy_callbacks.SignalParentToo",
    }[leg]
    args = (
        [f"+callbacks.sig._target_={target}"]
        + [f"+callbacks.sig.marker={marker}"] * (leg != "resumed")
        + [f"+callbacks.sig.sig={sig}", f"+callbacks.sig.step={step}"]
    )
    proc = python_train(["mode=verify_resume", *SHORT, *args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + getattr(signal, sig), out[-3000:]
    assert "Traceback" not in out and "PASS" not in out and "Likely cause" not in out, out[-3000:]
    [said] = [ln for ln in out.splitlines() if "stopped by" in ln]
    what = "the resumed run at 1 rank(s)" if leg == "resumed" else "the uninterrupted run"
    assert said.endswith(
        f"verify_resume: {what} was stopped by {sig} from outside at step {step}: nothing "
        "was compared. Fix: run the same command again (verify_resume starts both of its runs from "
        "scratch)"
    ), said


@pytest.mark.parametrize(
    "override,match",
    [
        (["verify.stop_at=0"], r"verify.stop_at=0: must be >= 1 or null"),
        (["verify.resume_nproc=0"], r"verify.resume_nproc=0: must be >= 1 or null"),
        (["verify.rtol=2"], r"verify.rtol=2.0: must be in \[0, 1\)"),
        (["distributed.strategy=fsdp"], r"distributed.strategy=fsdp saves shards. Fix: verify with "),
        (
            ["resume=auto"],
            r"resume=auto: mode=verify_resume starts both of its runs from scratch. Fix: drop resume",
        ),
    ],
)
def test_what_verify_resume_cannot_run_is_refused_in_one_line(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        verify.verify_resume(compose_cfg(["mode=verify_resume", *override], tmp_path / "run"))
    assert not (tmp_path / "run" / "verify_resume" / "uninterrupted").exists()  # nothing ran
