"""A job's end on a full disk, for real under each launcher, in a sweep and in a study. Its record of
completion (result.json): the job fails in one line, every rank alike, nothing writes another record in its
place, and ``resume=auto`` records the completion once there is room (found by the soak, seed 4908357, twice
in CI). A study's HParams rows and summary, which rank 0 alone writes, meet the full disk in one line each and
the study completes."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
from helpers.jobs import assert_ok, python_train, tmpfs, torchrun


@pytest.mark.slow  # a second or more: a training run
def test_a_completion_that_cannot_be_recorded_fails_the_job_instead_of_exit_0(tmp_path, monkeypatch):
    """The disk filled as the last checkpoint was written; the job said it could not write result.json and
    exited 0, so a sweep or a scheduler saw success with no record of it."""
    import logging

    from helpers.jobs import compose_cfg

    import ddplab
    from ddplab import rundir
    from ddplab.errors import ResourceError

    real = rundir.write_result

    def full_disk(run_dir, result):
        if result.get("status") != "completed":
            return real(run_dir, result)
        logging.getLogger("ddplab").error("could not write %s: [Errno 28] No space left on device", run_dir)
        return False

    monkeypatch.setattr(rundir, "write_result", full_disk)
    with pytest.raises(
        ResourceError, match=r"completed and its checkpoints are written, but its record .*resume=auto"
    ):
        ddplab.run(
            compose_cfg(
                ["model=mlp", "num_epochs=1", "limit_train_steps=2", "progress=none"], run_dir=tmp_path
            )
        )
    assert (tmp_path / "checkpoints" / "last.pt").is_file()
    assert not (tmp_path / "result.json").exists()  # no "failed" record of a job that completed


@pytest.mark.dist
@pytest.mark.parametrize("launch", ["torchrun-3", "self-launch-2"])
def test_a_completion_record_lost_to_a_full_disk_is_one_line_on_every_launcher_and_resume_auto_records_it(
    tmp_path, launch
):
    """torchrun x3 in CI: rank 0 could not write result.json and raised, while its peers waited in the last
    barrier and died of the lost connection with two tracebacks. Every rank now learns the record failed: rank
    0 says it once, nobody prints a traceback (self-launched: the peers let rank 0 speak first, and the parent
    writes no record in its place), and the same command with resume=auto (disk freed) records the
    completion."""
    n = 3 if launch == "torchrun-3" else 2
    with tmpfs(tmp_path / "disk", "size=16m") as disk:
        run = disk / "run"
        args = [
            "model=mlp",
            "batch_size=48",
            "num_epochs=1",
            "limit_train_steps=4",
            "progress=none",
            "checkpoint.async_save=true",
            f"hydra.run.dir={run}",
        ]
        go = (
            (lambda a: torchrun(n, a, tmp_path, timeout=180))
            if launch == "torchrun-3"
            else (lambda a: python_train(a + [f"distributed.nproc_per_node={n}"], tmp_path, timeout=180))
        )
        proc = go(args + ["+callbacks.fill._target_=toy.FillsDiskAtFitEnd", f"+callbacks.fill.disk={disk}"])
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-4000:]
        said = [ln for ln in out.splitlines() if "the job completed and its checkpoints are written" in ln]
        assert (
            len(said) == 1 and f"rank 0/{n} failed after training (completed): RecordWriteError" in said[0]
        ), out[-4000:]
        assert (
            said[0].endswith("resume=auto: it records the completion") and out.count("could not write") == 1
        ), out[-4000:]
        assert all("torch/distributed/run.py" in block[:800] for block in out.split("Traceback")[1:]), out[
            -4000:
        ]
        assert "Connection closed by peer" not in out and "received: stopping" not in out, out[-4000:]
        assert not (run / "result.json").exists() and (run / "checkpoints" / "last.pt").is_file()
        (disk / "filler").unlink()
        assert_ok(go(args + ["resume=auto"]))
        res = json.loads((run / "result.json").read_text())
        assert res["status"] == "completed" and res["metrics"]["step"] == 4, res


@pytest.mark.dist
def test_a_sweep_job_whose_record_is_lost_gets_no_record_in_its_place_and_the_summary_is_one_line(tmp_path):
    """A self-launched 2-rank job of a sweep: its parent wrote a "failed" record ("a rank failed (see its
    log)") over the completion the disk refused, once there was room; and the sweep's summary on the full disk
    was Hydra's warning with ddplab's OSError."""
    with tmpfs(tmp_path / "disk", "size=16m") as disk:
        sweep = disk / "sweep"
        proc = python_train(
            [
                "-m",
                "seed=1",
                "model=mlp",
                "num_epochs=1",
                "limit_train_steps=4",
                "progress=none",
                "distributed.nproc_per_node=2",
                f"hydra.sweep.dir={sweep}",
                "+callbacks.fill._target_=toy.FillsDiskAtFitEnd",
                f"+callbacks.fill.disk={disk}",
            ],
            tmp_path,
            timeout=180,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]  # the sweep goes on past a failed job
        assert "job failed, the sweep goes on: RecordWriteError: " in out, out[-4000:]
        assert [ln for ln in out.splitlines() if "could not write" in ln and "result.json" in ln] != []
        assert (
            not (sweep / "0" / "result.json").exists() and (sweep / "0" / "checkpoints" / "last.pt").is_file()
        )
        assert "Warning" not in out and "Traceback" not in out, out[-4000:]


@pytest.mark.slow  # a second or more: a study of two trials in this process
def test_a_study_whose_hparams_rows_and_summary_meet_a_full_disk_says_so_and_completes(
    tmp_path, monkeypatch, caplog
):
    """Under torchrun rank 0 alone writes a trial's HParams row, after the trial, while its peers wait for the
    next one; a full disk there ended the worker with a traceback (the peers: SIGTERMed in their wait). The
    study's summary on a full disk was a traceback too. Each is one line now, and the study goes on."""
    from helpers.jobs import compose_cfg
    from helpers.study import load, study_args

    from ddplab.study import run_study, summary

    def no_space(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    real = Path.write_text
    monkeypatch.setattr(summary, "write_hparams", no_space)
    monkeypatch.setattr(
        Path,
        "write_text",
        lambda self, *a, **k: no_space() if self.name.startswith("summary.") else real(self, *a, **k),
    )
    caplog.set_level(logging.INFO, logger="ddplab")
    run_study(compose_cfg(study_args(tmp_path / "s", 2), run_dir=tmp_path / "worker"))
    assert [t.state.name for t in load(tmp_path / "s").get_trials()] == ["COMPLETE", "COMPLETE"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert said == [
        f"trial {n}: its HParams row could not be written ([Errno 28] No space left on device); the study "
        "goes on"
        for n in (0, 1)
    ] + [f"could not write the study's summary in {tmp_path / 's'}: [Errno 28] No space left on device"], said
