"""Each error said once, in one line, by the process that should say it: a config error under torchrun, a rank
that fails alone (torchrun, self-launch), a read-only run dir or one in use, a full disk, a checkpoint that
cannot be read (resume=auto, mode=eval: exit 2)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers.jobs import TRAIN, assert_ok, python_train, tmpfs, torchrun

import ddplab


# ------------------------------------------------------------------ errors said once, plainly
@pytest.mark.dist
def test_a_config_error_under_torchrun_is_said_once_by_rank_zero_without_a_traceback(tmp_path):
    # a batch smaller than the world size (2 < 3): it cannot split either
    # (tests/integration/test_ddp_guarantees.py's case)
    proc = torchrun(3, ["model=mlp", "batch_size=2"], tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [ln for ln in out.splitlines() if "config error" in ln]
    assert len(lines) == 1 and "batch_size=2 (global) does not split evenly over 3 ranks" in lines[0], out
    assert out.index("config error") < out.index("ChildFailedError")  # first, before torchrun's summary
    # torchrun's own traceback only: no frame of ddplab's code or train.py (a path may still say "ddplab": a
    # checkout cloned as ddplab/ is in torchrun's summary, so the frames are what is checked).
    frames = re.findall(r'File "([^"]+)"', out)
    ours = [f for f in frames if f.startswith(str(Path(ddplab.__file__).parent)) or f == str(TRAIN)]
    assert ours == [], ours
    assert "ConfigError" not in out


@pytest.mark.dist
def test_a_rank_that_fails_alone_is_the_error_result_json_records_not_its_peers_lost_connection(tmp_path):
    """A callback raises on rank 1 only; rank 0 then loses its connection in the next collective. result.json
    and rank 0's line name rank 1's error; the peer's lost connection prints no traceback of its own."""
    proc = torchrun(
        2,
        [
            "model=mlp",
            "num_epochs=1",
            "progress=none",
            "+callbacks.fail._target_=toy.FailsOnRank",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    error = json.loads((tmp_path / "run" / "result.json").read_text())["error"]
    assert error.startswith(
        "rank 1/2 failed in epoch 1, step 4: RuntimeError: FailsOnRank: a callback's own bug on "
        "rank 1 at step 3"
    ), error
    # Rank 1's traceback (its own bug), torchrun's and its summary's copy of rank 1's: none from rank 0.
    assert "Connection closed" not in out and out.count("Traceback") == 3, out
    assert re.search(
        r"rank 0/2 stopped in epoch 1, step 4: lost its connection to rank 1, which failed first", out
    )
    assert len(out.splitlines()) <= 120, len(out.splitlines())  # 197 before: rank 0's traceback twice


@pytest.mark.dist
def test_a_self_launched_rank_that_fails_alone_is_said_once_by_the_parent_without_its_traceback(tmp_path):
    """The same bug, self-launched: the parent wrapped the rank's error, with its whole call stack as a repr'd
    dict, in a RuntimeError of its own that Hydra printed as a second traceback (135 lines, 6 tracebacks)."""
    proc = python_train(
        [
            "model=mlp",
            "num_epochs=1",
            "progress=none",
            "+callbacks.fail._target_=toy.FailsOnRank",
            "distributed.nproc_per_node=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    error = json.loads((tmp_path / "run" / "result.json").read_text())["error"]
    assert error.startswith("rank 1/2 failed in epoch 1, step 4: RuntimeError: FailsOnRank: "), error
    # Rank 1's own traceback, once (in torch's log of the failed process); none from the parent or rank 0.
    tracebacks = [ln for ln in out.splitlines() if ln.endswith("Traceback (most recent call last):")]
    assert len(tracebacks) == 2 and all(t.startswith("E1") for t in tracebacks), tracebacks  # the rank's: its
    # exception, and the spawn error torch chains to it
    [said] = [ln for ln in out.splitlines() if "self-launched job failed" in ln]
    assert said.endswith(
        "self-launched job failed: rank 1 (local 1) exited with code 1: RuntimeError: FailsOnRank: "
        "a callback's own bug on rank 1 at step 3 (its error and traceback are above)"
    ), said
    assert "extraInfo" not in out and "py_callstack" not in out


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_read_only_run_dir_is_one_clear_line(tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        proc = python_train([f"hydra.run.dir={ro}/run", "num_epochs=1"], tmp_path, timeout=60)
    assert proc.returncode == 2
    assert f"cannot write the run dir {ro}/run (Read-only file system at {ro})" in proc.stderr
    assert "Fix: hydra.run.dir=" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_named_run_dir_in_use_is_refused_before_hydra_writes_into_it(tmp_path):
    import os

    from ddplab.rundir import RunDirLock

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- the holder's overrides\n")
    held = RunDirLock(run)
    assert held.acquire() is None
    try:
        proc = python_train(["model=mlp", "num_epochs=1", f"hydra.run.dir={run}"], tmp_path, timeout=60)
    finally:
        held.release()
    assert proc.returncode == 2 and f"run dir {run} is in use by pid {os.getpid()} on " in proc.stderr
    assert (run / ".hydra" / "overrides.yaml").read_text() == "- the holder's overrides\n"
    assert sorted(p.name for p in run.iterdir()) == [".hydra"]  # no train.log, no config.yaml of ours


@pytest.mark.slow  # real processes on a tmpfs
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_full_disk_is_one_line_without_a_traceback_and_a_failed_self_launch_leaves_no_scratch(
    tmp_path, ranks
):
    """A full disk is the machine's fault, said completely by the error's one line (where, how much is free,
    the fix): it was followed by a traceback (one process: Hydra's of the CheckpointWriteError, async or not),
    and a failed self-launch left its rank 0's restart memo in TMPDIR (``ddplab-<uid>/run-<id>-<pid>``) for
    good."""
    (tmp_path / "tmp").mkdir()
    with tmpfs(tmp_path / "disk", "size=600k") as disk:  # room for logs and events, not the first checkpoint
        run = disk / "run"
        proc = python_train(
            [
                "model=mlp",
                "num_epochs=1",
                "progress=none",
                "checkpoint.async_save=true",
                f"distributed.nproc_per_node={ranks}",
                f"hydra.run.dir={run}",
            ],
            tmp_path,
            timeout=180,
            extra_env={"TMPDIR": str(tmp_path / "tmp")},
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    said = [ln for ln in out.splitlines() if "CheckpointWriteError: could not write checkpoint" in ln]
    assert said and all(
        "No space left on device" in ln and "MiB free on its file system" in ln for ln in said
    ), out
    assert [ln for ln in out.splitlines() if "Traceback" in ln] == [], out[-4000:]
    assert list((tmp_path / "tmp").glob(f"ddplab-{os.getuid()}/run-*")) == []


@pytest.mark.slow  # real processes: a run, then its resume
@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_a_resume_with_no_readable_checkpoint_is_one_line_with_exit_2(tmp_path, launch):
    """Every checkpoint of the run spoilt (the soak's bad_file): ``resume=auto`` said so with the right fix,
    but as a RuntimeError with exit 1 and a traceback; a file the job reads is an input error (exit 2, one
    line). Under torchrun every rank met it and said it (the soak's trial 839914002): rank 0 alone says it,
    like a config error; torchrun's own exit is 1 and its report shows the ranks' 2."""
    run = tmp_path / "run"
    args = ["model=mlp", "num_epochs=1", "limit_train_steps=4", "progress=none", f"hydra.run.dir={run}"]
    go = (lambda a: python_train(a, tmp_path)) if launch == "python" else (lambda a: torchrun(2, a, tmp_path))
    assert_ok(go(args))
    [step] = (run / "checkpoints").glob("step-*.pt")
    step.write_bytes(step.read_bytes()[:100])  # last.pt is the same file under another name
    proc = go(args + ["resume=auto"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == (2 if launch == "python" else 1), out[-3000:]
    assert launch == "python" or out.split("Root Cause")[-1].split("exitcode  :")[1].split()[0] == "2", out[
        -3000:
    ]
    assert all("torch/distributed/run.py" in block[:800] for block in out.split("Traceback")[1:]), out[-3000:]
    [said] = [ln for ln in out.splitlines() if "could be read" in ln]
    assert said.endswith(
        f"resume=auto: none of {[str(run / 'checkpoints' / 'last.pt'), str(step)]} could be read. "
        "Fix: resume=null to start fresh, or resume=<path> to a good checkpoint."
    ), said


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_an_unreadable_checkpoint_for_mode_eval_is_one_line_with_exit_2(tmp_path):
    """mode=eval loads its checkpoint outside a training Session: the error, an input error now, was said by
    nobody (exit 2, no output at all)."""
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint" * 8)
    proc = python_train(
        ["model=mlp", "mode=eval", f"resume={bad}", "progress=none", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    [said] = [ln for ln in out.splitlines() if "cannot read checkpoint" in ln]
    assert f"error: resume: cannot read checkpoint {bad} (truncated or corrupt?)" in said, said
