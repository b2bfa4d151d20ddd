"""Runs that never get mixed up and never fail silently: config drift on resume, the earlier-run
search, a full disk, waits bounded by distributed.timeout_s, and config errors said once."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers.compare import load
from helpers.jobs import (
    TRAIN,
    assert_ok,
    compose_cfg,
    free_port,
    job_env,
    python_train,
    read_scalars,
    tmpfs,
    torchrun,
)

import ddplab
from ddplab.checkpoint import files
from ddplab.config import ConfigError
from ddplab.runtime.watch import GRACE_S

BASE = ["model=mlp", "num_epochs=2", "progress=none"]  # digits: 22 steps per epoch


# ------------------------------------------------------------------ config drift on resume
@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_resume_with_a_changed_config_is_refused_listing_every_difference(tmp_path):
    ddplab.run(compose_cfg(BASE + ["stop_after_epochs=1"], tmp_path / "a"))
    with pytest.raises(ConfigError) as e:
        ddplab.run(
            compose_cfg(
                BASE + [f"resume={tmp_path / 'a'}", "optimizer.lr=0.5", "batch_size=32"], tmp_path / "b"
            )
        )
    msg = str(e.value)
    assert "optimizer.lr: 0.1 in the checkpoint -> 0.5 now" in msg
    assert "batch_size: 64 in the checkpoint -> 32 now" in msg
    assert "resume_apply_changes=true" in msg and "Fix:" in msg
    assert not (tmp_path / "b" / "checkpoints").exists()  # refused before anything trained
    # Keys that do not change the trajectory never block a resume.
    out = ddplab.run(
        compose_cfg(
            BASE + [f"resume={tmp_path / 'a'}", "log_every_n_steps=3", "checkpoint.keep_last=4"],
            tmp_path / "c",
        )
    )
    assert out["step"] == 44


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_resume_apply_changes_uses_the_new_lr_from_the_first_resumed_step_and_records_it(tmp_path):
    ddplab.run(compose_cfg(BASE + ["stop_after_epochs=1"], tmp_path / "a"))
    same = BASE + [f"resume={tmp_path / 'a'}", "log_every_n_steps=1"]
    ddplab.run(compose_cfg(same, tmp_path / "old"))
    ddplab.run(compose_cfg(same + ["optimizer.lr=0.5", "resume_apply_changes=true"], tmp_path / "new"))
    old, new = (read_scalars(tmp_path / d / "tb")["vitals/lr"] for d in ("old", "new"))
    assert [s for s, _ in new] == list(range(23, 45))  # from the first resumed step on
    for (s, lo), (_, ln) in zip(old, new):
        # 0.5 / 0.1 (float32 events): same schedule, new base
        assert ln == pytest.approx(5 * lo, rel=1e-6, abs=1e-12), s
    assert new[0][1] > 0.1  # not the checkpoint's lr
    changes = yaml.safe_load((tmp_path / "new" / "config_changes.yaml").read_text())
    assert changes[0]["step"] == 22 and changes[0]["changes"]["optimizer.lr"] == {
        "checkpoint": 0.1,
        "now": 0.5,
    }
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "new" / "tb"))
    acc.Reload()
    assert "config_changes/text_summary" in acc.Tags()["tensors"]


def test_a_batch_change_mid_epoch_is_refused_even_with_the_opt_in(tmp_path):
    ddplab.run(
        compose_cfg(
            BASE + ["num_epochs=1", "checkpoint.every_n_steps=5", "checkpoint.keep_last=10"], tmp_path / "a"
        )
    )
    mid = tmp_path / "a" / "checkpoints" / "step-00000005.pt"
    with pytest.raises(
        ConfigError, match=r"batch_size changed, but .* was saved mid-epoch \(5 steps into it\)"
    ):
        ddplab.run(
            compose_cfg(
                BASE + ["num_epochs=1", f"resume={mid}", "batch_size=32", "resume_apply_changes=true"],
                tmp_path / "b",
            )
        )


# ------------------------------------------------------------------ the earlier-run search
def _fake_run(d: Path, overrides: list[str], config: str, mtime: float) -> Path:
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    ck = d / "checkpoints" / "last.pt"
    ck.parent.mkdir()
    torch.save({"meta": {"config": config}}, ck)
    import os

    os.utime(ck, (mtime, mtime))
    return ck


def test_resume_auto_search_matches_the_config_digest_and_stays_in_its_own_root(tmp_path):
    from ddplab.config import drift

    cfg = "model:\n  name: a\noptimizer:\n  lr: 0.1\nresume: auto\n"
    other = "model:\n  name: a\noptimizer:\n  lr: 0.2\nresume: auto\n"
    ov = ["model=mlp"]
    mine = tmp_path / "outputs" / "2026-01-02" / "10-00-00"
    (mine / ".hydra").mkdir(parents=True)
    (mine / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(ov + ["resume=auto"]))
    # Newest first: a sweep job in multirun/ (another root), then a run whose config differs, then the match.
    _fake_run(tmp_path / "multirun" / "2026-01-02" / "09-00-00" / "0", ov, cfg, 300)
    _fake_run(tmp_path / "outputs" / "2026-01-01" / "09-00-00", ov, other, 200)
    match = _fake_run(tmp_path / "outputs" / "2026-01-01" / "08-00-00", ov, cfg, 100)
    assert files.find_resume_path("auto", mine, True, drift.trajectory_digest(cfg)) == match
    assert files.find_resume_path("auto", mine, True, drift.trajectory_digest("model:\n  name: b\n")) is None
    # Harmless keys (where it runs, how long this invocation lasts) do not change the digest.
    assert drift.trajectory_digest(cfg) == drift.trajectory_digest(
        cfg.replace("resume: auto", "resume: null") + "stop_after_epochs: 1\n"
    )


# ------------------------------------------------------------------ a full disk
@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_full_disk_removes_the_partial_file_names_path_and_space_and_a_retry_continues(tmp_path, monkeypatch):
    args = BASE + ["checkpoint.every_n_steps=5"]
    real_save, calls = torch.save, []

    def full_disk(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 3:  # the step-15 checkpoint: half written, then the disk is full
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(files.CheckpointWriteError) as e:
        ddplab.run(compose_cfg(args, tmp_path / "run"))
    msg = str(e.value)
    ckdir = tmp_path / "run" / "checkpoints"
    assert f"could not write checkpoint {ckdir / 'step-00000015.pt'}" in msg
    assert re.search(r"No space left on device \([\d.]+ MiB free on its file system\)", msg)
    assert "resume=auto" in msg
    # no tmp
    assert sorted(p.name for p in ckdir.iterdir()) == [
        "last.pt",
        "save_seconds.json",
        "step-00000005.pt",
        "step-00000010.pt",
    ]
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["status"] == "failed" and "step-00000015.pt" in res["error"]

    monkeypatch.setattr(torch, "save", real_save)  # space freed: the same command continues
    rest = ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path / "run"))
    ref = ddplab.run(compose_cfg(args, tmp_path / "ref"))
    assert rest["step"] == 44 and rest["val/acc"] == ref["val/acc"]
    a, b = load(ckdir / "last.pt")["model"], load(tmp_path / "ref" / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.dist
def test_a_full_disk_during_a_sharded_save_fails_every_rank_clearly_and_leaves_no_partial_shards(tmp_path):
    """distributed=fsdp: every rank writes its own shards, so every rank meets the full disk. Each says where
    and how much space is left (it was "RuntimeError: [enforce fail at inline_container.cc:672] unexpected
    pos" with a traceback per rank, partial shards left and no result.json)."""
    with tmpfs(tmp_path / "disk", "size=600k") as disk:
        run = disk / "run"  # room for the logs and events, not for the first checkpoint's ~0.6 MB of shards
        proc = torchrun(
            2,
            [
                "model=mlp",
                "num_epochs=1",
                "distributed=fsdp",
                "distributed.timeout_s=20",
                f"hydra.run.dir={run}",
            ],
            tmp_path,
            timeout=180,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        for r in (0, 1):
            assert re.search(
                rf"rank {r}/2 failed in epoch \d, step 23: CheckpointWriteError: could not write "
                rf"sharded checkpoint {re.escape(str(run / 'checkpoints'))}/step-00000022\.dcp",
                out,
            ), out[-4000:]
        assert re.search(r"\([\d.]+ MiB free on its file system\)", out) and "resume=auto" in out
        assert re.search(r"rank\(s\) \[[01, ]+\] failed to write: ", out)  # DCP's failures, as one line
        # shards gone
        assert [p.name for p in (run / "checkpoints").iterdir() if p.name.endswith(".dcp")] == []
        res = json.loads((run / "result.json").read_text())
        assert res["status"] == "failed" and "could not write sharded checkpoint" in res["error"]


# ------------------------------------------------------------------ waits bounded by the timeout
@pytest.mark.dist
def test_a_lone_rank_says_what_it_waits_for_and_gives_up_soon_after_the_timeout(tmp_path):
    timeout = 8
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), "model=mlp", f"distributed.timeout_s={timeout}"],
        cwd=tmp_path,
        env={**job_env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    hung = threading.Timer(120, os.killpg, (proc.pid, signal.SIGKILL))
    hung.start()
    lines, began = [], None
    waiting = f"rank 1/2: waiting for all 2 ranks to join at 127.0.0.1:{env['MASTER_PORT']}: "
    for line in proc.stdout:  # read as printed: when the wait began, from its first notice ("5s so far")
        lines.append(line)
        said = re.search(re.escape(waiting) + r"(\d+)s so far", line)
        if began is None and said:
            began = time.monotonic() - int(said.group(1))
    proc.wait()
    hung.cancel()
    out = "".join(lines)
    assert proc.returncode != 0 and began is not None, out[-3000:]
    # The wait, not the start-up before it (seconds on a loaded machine): the timeout, the grace, the
    # notice's rounding (0.5 s) and the exit.
    took = time.monotonic() - began
    assert took < timeout + GRACE_S + 1.5, (took, out[-3000:])


@pytest.mark.dist
def test_file_init_in_a_missing_dir_is_refused_at_once_under_torchrun(tmp_path):
    t0 = time.monotonic()
    proc = torchrun(
        2, ["model=mlp", f"distributed.init_method=file://{tmp_path}/missing/dir/x"], tmp_path, timeout=120
    )
    assert proc.returncode != 0 and time.monotonic() - t0 < 30
    out = proc.stdout + proc.stderr
    assert out.count(f"its directory {tmp_path}/missing/dir does not exist") == 1, out[-3000:]


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_more_local_ranks_than_cores_is_refused_with_the_count(tmp_path):
    import os

    cores = len(os.sched_getaffinity(0))
    proc = python_train(
        [f"distributed.nproc_per_node={cores + 62}", "distributed.device=cpu"], tmp_path, timeout=60
    )
    assert proc.returncode == 2
    assert (
        f"distributed.nproc_per_node={cores + 62}: this machine has {cores} CPU cores"
        in proc.stderr + proc.stdout
    )
    assert "distributed.oversubscribe_cpu=true" in proc.stderr + proc.stdout  # the other fix it names
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cpu_ranks_share_the_cores_when_the_user_lets_them(tmp_path):
    import os

    more = len(os.sched_getaffinity(0)) + 1
    proc = python_train(
        [
            "model=mlp",
            "max_steps=2",
            f"batch_size={16 * more}",
            f"distributed.nproc_per_node={more}",
            "distributed.device=cpu",
            "distributed.oversubscribe_cpu=true",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{more} rank(s) on cpu (gloo)" in proc.stdout


# ------------------------------------------------------------------ errors said once, plainly
@pytest.mark.dist
def test_a_config_error_under_torchrun_is_said_once_by_rank_zero_without_a_traceback(tmp_path):
    # a batch smaller than the world size (2 < 3): it cannot split either (tests/test_ddp_guarantees.py's
    # case)
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


def test_a_model_that_cannot_take_the_image_size_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot train on .*dataset.image_size=1.* Fix: "):
        ddplab.run(compose_cfg(["dataset=synthetic", "dataset.image_size=1", "num_epochs=1"], tmp_path / "r"))


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


def test_a_log_file_on_a_full_disk_is_given_up_in_one_line(capfd):
    """The run dir's disk filled mid-run (the soak's seed 1126, trial 1592107938): the checkpoint's one line
    was followed by logging's "--- Logging error ---" and a traceback for every record train.log could not
    take, each chained to the error being reported (80 lines). The file is now given up once, in one line."""
    import logging

    from ddplab.runtime.console import quiet_log_files

    full = logging.FileHandler("/dev/full")  # every write: ENOSPC
    logging.getLogger().addHandler(full)
    try:
        quiet_log_files()
        try:
            raise OSError(28, "No space left on device")
        except OSError:  # records logged while an error is being handled, as the Session's is
            for i in range(3):
                logging.getLogger("ddplab").error("line %d", i)
    finally:
        logging.getLogger().removeHandler(full)
        full.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err, err
    assert (
        err.count(
            "ddplab: stopped writing /dev/full: [Errno 28] No space left on device (the console keeps "
            "the log)"
        )
        == 1
    ), err
