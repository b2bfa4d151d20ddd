"""Runs that never get mixed up and never fail silently, trained for real: config drift on resume refused or
applied, a full disk (one process, FSDP's shards), waits bounded by distributed.timeout_s, ranks against
cores, a batch change mid-epoch, a model that cannot take the image size."""

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

import pytest
import torch
import yaml
from helpers.compare import load
from helpers.integrity import BASE
from helpers.jobs import TRAIN, compose_cfg, free_port, job_env, python_train, read_scalars, tmpfs, torchrun

import ddplab
from ddplab.checkpoint import files
from ddplab.config import ConfigError
from ddplab.runtime.watch import GRACE_S


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


def test_a_model_that_cannot_take_the_image_size_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot train on .*dataset.image_size=1.* Fix: "):
        ddplab.run(compose_cfg(["dataset=synthetic", "dataset.image_size=1", "num_epochs=1"], tmp_path / "r"))
