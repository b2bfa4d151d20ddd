"""checkpoint.async_save=true: the loop pauses only to copy the state; a background thread writes it.
The files are the synchronous saves' bit for bit; a stop waits for the write in flight and then saves
its own step; a write killed half-way is never resumed; a full disk fails the run cleanly, every rank."""

from __future__ import annotations

import errno
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddplab
import toy
from ddplab.checkpoint import files
from helpers.compare import assert_same_checkpoint, load
from helpers.jobs import TRAIN, assert_ok, compose_cfg, job_env, run_cmd, tmpfs, torchrun
from test_preemption import finish, result, start

pytestmark = pytest.mark.slow

ASYNC = ["checkpoint.async_save=true"]
BASE = ["model=mlp", "num_epochs=2", "checkpoint.every_n_steps=5"]  # digits: 22 steps per epoch
# Each training forward sleeps 10 ms, so a run lasts long enough for a stop to land mid-run.
SLOW = ["model=mlp", "model._target_=toy.SlowMLP", "+model.delay_s=0.01", "num_epochs=2", "log_every_n_steps=5",
        "checkpoint.every_n_steps=10", "progress=log"]


def _step_files(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("*.pt"))


def test_async_saves_write_the_sync_saves_bitwise_and_hold_the_loop_a_fraction_as_long(tmp_path):
    """About 75 MB of state (a 3072-wide layer and its momentum): the loop's pause per save is compared with
    a synchronous save of the same state, as a ratio (no absolute time)."""
    big = BASE + ["model.hidden=[3072,3072]", "checkpoint.every_n_steps=4", "num_epochs=1", "checkpoint.keep_last=9",
                  "+callbacks.stall._target_=toy.StallRecorder"]
    stalls = {}
    for mode, extra in (("sync", []), ("async", ASYNC)):
        toy.STALLS.clear()
        ddplab.run(compose_cfg(big + extra, tmp_path / mode))
        stalls[mode] = [s for _, s in toy.STALLS]
    assert len(stalls["sync"]) == len(stalls["async"]) == 6  # steps 4..20 and the epoch's end, 22
    assert _step_files(tmp_path / "sync") == _step_files(tmp_path / "async")
    for name in _step_files(tmp_path / "sync"):
        assert_same_checkpoint(tmp_path / "sync" / "checkpoints" / name, tmp_path / "async" / "checkpoints" / name)
    mean = {m: sum(v[1:]) / len(v[1:]) for m, v in stalls.items()}  # the first async save allocates its buffers
    assert mean["async"] < 0.35 * mean["sync"], stalls
    # The run waits for its last write: result.json says completed only with last.pt on disk.
    assert load(tmp_path / "async" / "checkpoints" / "last.pt")["meta"] is not None


def test_a_full_disk_in_the_background_write_fails_the_run_cleanly_and_a_retry_continues(tmp_path, monkeypatch, caplog):
    real_save, calls = torch.save, []

    def full_disk(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 3:  # the step-15 checkpoint, written in the background: half, then the disk is full
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(files.CheckpointWriteError) as e:
        ddplab.run(compose_cfg(BASE + ASYNC, tmp_path / "run"))
    msg, ckdir = str(e.value), tmp_path / "run" / "checkpoints"
    assert f"could not write checkpoint {ckdir / 'step-00000015.pt'}" in msg
    assert re.search(r"No space left on device \([\d.]+ MiB free on its file system\)", msg) and "resume=auto" in msg
    # Said at the next step (not at the next save): nothing after the failed write was written, no partial file left.
    assert sorted(p.name for p in ckdir.iterdir()) == ["last.pt", "save_seconds.json", "step-00000005.pt",
                                                      "step-00000010.pt"]
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["status"] == "failed" and "step-00000015.pt" in res["error"], res
    # Every save after the failed write is refused: the loop stops as soon as it hears of the failure (a step
    # or two later, as the writer thread is scheduled) and at the latest at the next save (step 20: said as 21).
    said = [int(n) for n in re.findall(r"failed in epoch 1, step (\d+): CheckpointWriteError", caplog.text)]
    assert len(said) == 1 and 16 <= said[0] <= 21, caplog.text

    monkeypatch.setattr(torch, "save", real_save)  # space freed: the same command continues
    rest = ddplab.run(compose_cfg(BASE + ASYNC + ["resume=auto"], tmp_path / "run"))
    ref = ddplab.run(compose_cfg(BASE, tmp_path / "ref"))
    assert rest["step"] == 44 and rest["val/acc"] == ref["val/acc"]
    assert_same_checkpoint(ckdir / "last.pt", tmp_path / "ref" / "checkpoints" / "last.pt")


@pytest.mark.dist
def test_a_stop_during_a_background_write_waits_for_it_and_a_write_killed_half_way_is_never_resumed(tmp_path):
    run, log = tmp_path / "run", tmp_path / "run.log"
    cmd = [sys.executable, str(TRAIN), *SLOW, *ASYNC, f"hydra.run.dir={run}"]
    # 1. SIGTERM right after step 10's checkpoint was handed over; its write takes 2 s.
    proc = start(cmd + ["+callbacks.disk._target_=toy.SlowDisk", "+callbacks.disk.delay_s=2",
                        "+callbacks.disk.signal_at=10"], tmp_path, log)
    took = finish(proc, log, timeout=60)
    out = log.read_text()
    res = result(run)
    assert res["status"] == "preempted" and res["signal"] == "SIGTERM", out[-3000:]
    stop = res["step"]
    assert 10 < stop <= 15 and res["checkpoint"].endswith(f"step-{stop:08d}.pt"), res
    assert re.search(rf"checkpoint at step {stop} waited [\d.]+s for the previous background write", out), out[-3000:]
    assert _step_files(run) == ["best.pt", "last.pt", f"step-{10:08d}.pt", f"step-{stop:08d}.pt"] \
        or _step_files(run) == ["last.pt", f"step-{10:08d}.pt", f"step-{stop:08d}.pt"]
    assert load(run / "checkpoints" / "last.pt")["meta"]["config"]  # the stop's own save, complete
    assert took < 15, took  # both writes (2 s each) well inside a launcher's 30 s grace

    # 2. Resumed, then SIGKILLed half-way through writing step 30's file (in the background).
    proc = subprocess.run(cmd + ["resume=auto", "+callbacks.disk._target_=toy.SlowDisk", "+callbacks.disk.kill_at=30"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=job_env())
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckdir = run / "checkpoints"
    assert any(p.name.startswith(".step-00000030.pt.tmp") for p in ckdir.iterdir())  # the half-written file
    assert "step-00000030.pt" not in _step_files(run)
    # 3. resume=auto takes the newest complete checkpoint (step 22, the epoch end), never the partial one, and ends bitwise.
    proc = run_cmd(cmd + ["resume=auto"], tmp_path, timeout=120)
    assert_ok(proc)
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "resumed from" in ln]
    assert len(said) == 1 and re.search(r"resumed from \S*last\.pt: 1 epoch\(s\), 22 step\(s\) done", said[0]), said
    assert not any(".tmp" in p.name for p in ckdir.iterdir())
    ref = tmp_path / "ref"
    assert_ok(run_cmd([sys.executable, str(TRAIN), *SLOW, f"hydra.run.dir={ref}"], tmp_path, timeout=120))
    assert_same_checkpoint(ckdir / "last.pt", ref / "checkpoints" / "last.pt")


@pytest.mark.dist
def test_two_ranks_fsdp_async_matches_sync_and_a_full_disk_fails_every_rank(tmp_path):
    """FSDP's sharded checkpoints through DCP's async_save: the run resumes from the shards written in the
    background to the uninterrupted run's end; on a disk too small for them every rank fails with one line,
    no shards left."""
    fsdp = ["model=mlp", "num_epochs=1", "distributed=fsdp", "checkpoint.every_n_steps=10", "distributed.timeout_s=30"]
    a, c = tmp_path / "async", tmp_path / "resumed"
    assert_ok(torchrun(2, fsdp + ASYNC + [f"hydra.run.dir={a}"], tmp_path, timeout=180))
    assert sorted(p.name for p in (a / "checkpoints").glob("*.dcp")) == ["step-00000020.dcp", "step-00000022.dcp"]
    # The shards written in the background resume (by their step file, synchronously) to the same end: complete.
    assert_ok(torchrun(2, fsdp + [f"hydra.run.dir={c}", f"resume={a / 'checkpoints' / 'step-00000020.pt'}"],
                       tmp_path, timeout=180))
    val = {r: json.loads((r / "result.json").read_text())["metrics"]["val/loss"] for r in (a, c)}
    assert val[a] == val[c], val

    with tmpfs(tmp_path / "disk", "size=600k") as disk:
        run = disk / "run"  # room for the logs and events, not for the first checkpoint's ~0.6 MB of shards
        proc = torchrun(2, fsdp + ASYNC + [f"hydra.run.dir={run}"], tmp_path, timeout=180)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        # Said on every rank at the same step, before the run goes past its next save (step 20).
        said = {int(r): int(st) for r, st in re.findall(
            rf"rank (\d)/2 failed in epoch 1, step (\d+): CheckpointWriteError: could not write sharded checkpoint "
            rf"{re.escape(str(run / 'checkpoints'))}/step-00000010\.dcp", out)}
        assert said.keys() == {0, 1} and len(set(said.values())) == 1 and 11 <= said[0] <= 21, out[-4000:]
        assert [p.name for p in (run / "checkpoints").iterdir() if p.name.endswith(".dcp")] == []
        assert json.loads((run / "result.json").read_text())["status"] == "failed"
