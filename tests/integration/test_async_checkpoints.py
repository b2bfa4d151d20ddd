"""checkpoint.async_save=true, the background write: the loop pauses only to copy the state; a thread writes
it. The files are the synchronous saves' bit for bit (one process, and 2 DDP ranks told of each at the same
step); on_save is told of each once it is on disk; a stop waits for the write in flight and then saves its own
step; a write killed half-way is never resumed; a full disk fails the run cleanly and a retry continues.
Failures and stops across 2 ranks, and FSDP: tests/integration/test_async_checkpoints_ranks.py."""

from __future__ import annotations

import errno
import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import toy
from helpers.async_saves import ASYNC, _step_files
from helpers.compare import assert_same_checkpoint, load, result
from helpers.jobs import TRAIN, assert_ok, compose_cfg, run_cmd, torchrun
from helpers.processes import finish, start

import ddplab
from ddplab.checkpoint import files

pytestmark = pytest.mark.slow

BASE = ["model=mlp", "num_epochs=2", "checkpoint.every_n_steps=5"]  # digits: 22 steps per epoch
# Each training forward sleeps 10 ms, so a run lasts long enough for a stop to land mid-run.
SLOW = [
    "model=mlp",
    "model._target_=toy.SlowMLP",
    "+model.delay_s=0.01",
    "num_epochs=2",
    "log_every_n_steps=5",
    "checkpoint.every_n_steps=10",
    "progress=log",
]


def test_async_saves_write_the_sync_saves_bitwise_and_the_loop_goes_on_while_they_write(tmp_path):
    """About 75 MB of state (a 3072-wide layer and its momentum). Async: each step file's write is held until
    the loop has taken two more steps, so the loop went on while it was written (a synchronous save holds the
    loop for the whole write: the held disk lets it go only by its clock). How much shorter the loop's pause
    is, is a benchmark's figure (scripts/bench_checkpoint.py, docs/performance.md), not a timed test's."""
    big = BASE + [
        "model.hidden=[3072,3072]",
        "checkpoint.every_n_steps=4",
        "num_epochs=1",
        "checkpoint.keep_last=9",
        "+callbacks.stall._target_=toy.StallRecorder",
    ]
    held = [
        "+callbacks.disk._target_=toy.DiskHeldForTwoSteps",
        "+callbacks.disk.steps=[4,8,12,16,20]",
        "+callbacks.disk.wait_s=20",
    ]  # a write the loop waited for: 20 s each, then False
    stalls = {}
    toy.HELD.clear()
    for mode, extra in (("sync", []), ("async", ASYNC + held)):
        toy.STALLS.clear()
        ddplab.run(compose_cfg(big + extra, tmp_path / mode))
        stalls[mode] = [s for _, s in toy.STALLS]
    assert len(stalls["sync"]) == len(stalls["async"]) == 6  # steps 4..20 and the epoch's end, 22
    assert _step_files(tmp_path / "sync") == _step_files(tmp_path / "async")
    for name in _step_files(tmp_path / "sync"):
        assert_same_checkpoint(
            tmp_path / "sync" / "checkpoints" / name, tmp_path / "async" / "checkpoints" / name
        )
    # each let go by the loop's steps
    assert toy.HELD == [(f"step-{k:08d}.pt", True) for k in (4, 8, 12, 16, 20)]
    # The run waits for its last write: result.json says completed only with last.pt on disk.
    assert load(tmp_path / "async" / "checkpoints" / "last.pt")["meta"] is not None


# each write takes 50 ms more
UPLOAD = [
    "+callbacks.disk._target_=toy.SlowDisk",
    "+callbacks.disk.delay_s=0.05",
    "+callbacks.up._target_=toy.LoadsEachSave",
]


def test_on_save_is_told_of_each_async_checkpoint_once_it_is_on_disk_and_of_the_sync_runs_ones(tmp_path):
    """A callback that uploads (here: loads) the checkpoint it is told of: with async_save it is told once the
    file is on disk — at the next save, or at the run's end — of the same checkpoints as a synchronous run."""
    seen = {}
    for mode, extra in (("sync", []), ("async", ASYNC)):
        rec = tmp_path / f"{mode}-saves"
        ddplab.run(compose_cfg(BASE + extra + UPLOAD + [f"+callbacks.up.record={rec}"], tmp_path / mode))
        seen[mode] = toy.saves_seen(str(rec))
    steps = [5, 10, 15, 20, 22, 25, 30, 35, 40, 44]
    assert seen["sync"] == [(s, str(s)) for s in steps]
    assert seen["async"] == [(at, str(s)) for at, s in zip(steps[1:] + [44], steps)], seen["async"]


@pytest.mark.dist
def test_two_rank_ddp_async_writes_the_sync_files_and_every_rank_is_told_of_each_at_the_same_step(tmp_path):
    """The default strategy (2-rank DDP): the step files are the synchronous run's bit for bit, and on_save
    fires on both ranks at the same step, each time with a file that loads."""
    args = [
        "model=mlp",
        "num_epochs=1",
        "checkpoint.every_n_steps=5",
        "checkpoint.keep_last=9",
        "progress=log",
    ]
    for mode, extra in (("sync", []), ("async", ASYNC)):
        run = tmp_path / mode
        assert_ok(
            torchrun(
                2,
                args
                + extra
                + UPLOAD
                + [f"+callbacks.up.record={tmp_path / mode}-saves", f"hydra.run.dir={run}"],
                tmp_path,
                timeout=240,
            )
        )
    assert _step_files(tmp_path / "sync") == _step_files(tmp_path / "async")
    for name in _step_files(tmp_path / "sync"):
        assert_same_checkpoint(
            tmp_path / "sync" / "checkpoints" / name, tmp_path / "async" / "checkpoints" / name
        )
    steps = [5, 10, 15, 20, 22]
    for rank in (0, 1):
        assert toy.saves_seen(f"{tmp_path}/sync-saves", rank) == [(s, str(s)) for s in steps]
        got = toy.saves_seen(f"{tmp_path}/async-saves", rank)
        assert got == [(at, str(s)) for at, s in zip(steps[1:] + [22], steps)], (rank, got)


def test_a_full_disk_in_the_background_write_fails_the_run_cleanly_and_a_retry_continues(
    tmp_path, monkeypatch, caplog
):
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
    assert (
        re.search(r"No space left on device \([\d.]+ MiB free on its file system\)", msg)
        and "resume=auto" in msg
    )
    # Said at the next step (not at the next save): nothing after the failed write was written, no partial
    # file left.
    assert sorted(p.name for p in ckdir.iterdir()) == [
        "last.pt",
        "save_seconds.json",
        "step-00000005.pt",
        "step-00000010.pt",
    ]
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["status"] == "failed" and "step-00000015.pt" in res["error"], res
    # Every save after the failed write is refused: the loop stops as soon as it hears of the failure (a step
    # or two later, as the writer thread is scheduled) and at the latest at the next save (step 20: said as
    # 21).
    said = [int(n) for n in re.findall(r"failed in epoch 1, step (\d+): CheckpointWriteError", caplog.text)]
    assert len(said) == 1 and 16 <= said[0] <= 21, caplog.text

    monkeypatch.setattr(torch, "save", real_save)  # space freed: the same command continues
    rest = ddplab.run(compose_cfg(BASE + ASYNC + ["resume=auto"], tmp_path / "run"))
    ref = ddplab.run(compose_cfg(BASE, tmp_path / "ref"))
    assert rest["step"] == 44 and rest["val/acc"] == ref["val/acc"]
    assert_same_checkpoint(ckdir / "last.pt", tmp_path / "ref" / "checkpoints" / "last.pt")


@pytest.mark.dist
def test_a_stop_during_a_background_write_waits_for_it_and_saves_its_own_step(tmp_path):
    run, log = tmp_path / "run", tmp_path / "run.log"
    cmd = [sys.executable, str(TRAIN), *SLOW, *ASYNC, f"hydra.run.dir={run}"]
    # SIGTERM as step 10's checkpoint starts being written in the background; its write takes 2 s.
    note = tmp_path / "signalled"
    proc = start(
        cmd
        + [
            "+callbacks.disk._target_=toy.SlowDisk",
            "+callbacks.disk.delay_s=2",
            "+callbacks.disk.signal_at=10",
            f"+callbacks.disk.note={note}",
        ],
        tmp_path,
        log,
    )
    finish(proc, log, timeout=60)
    took = time.time() - float(note.read_text())  # from the signal (the start-up before it is no part of it)
    out = log.read_text()
    res = result(run)
    assert res["status"] == "preempted" and res["signal"] == "SIGTERM", out[-3000:]
    stop = res["step"]
    assert 10 < stop <= 15 and res["checkpoint"].endswith(f"step-{stop:08d}.pt"), res
    assert re.search(rf"checkpoint at step {stop} waited [\d.]+s for the previous background write", out), (
        out[-3000:]
    )
    assert _step_files(run) == [
        "best.pt",
        "last.pt",
        f"step-{10:08d}.pt",
        f"step-{stop:08d}.pt",
    ] or _step_files(run) == ["last.pt", f"step-{10:08d}.pt", f"step-{stop:08d}.pt"]
    assert load(run / "checkpoints" / "last.pt")["meta"]["config"]  # the stop's own save, complete
    assert took < 15, took  # both writes (2 s each) well inside a launcher's 30 s grace


@pytest.mark.dist
def test_the_real_writer_killed_mid_write_leaves_a_partial_temporary_file_only_and_resume_skips_it(tmp_path):
    """SIGKILL inside the writer thread's torch.save, 64 KiB into step 30's file: those bytes are on disk
    under the temporary name only (every *.pt loads), and resume=auto continues from step 22 and ends
    bitwise."""
    run, note, ckdir = tmp_path / "run", tmp_path / "note", tmp_path / "run" / "checkpoints"
    cmd = [sys.executable, str(TRAIN), *SLOW, *ASYNC, f"hydra.run.dir={run}"]
    proc = run_cmd(
        cmd
        + ["+callbacks.die._target_=toy.DiesMidWrite", "+callbacks.die.at=30", f"+callbacks.die.note={note}"],
        tmp_path,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    thread, name, size = note.read_text().split()
    partial = Path(name)
    assert thread == "ddplab-checkpoint-writer"  # the real background writer, inside torch.save
    assert partial.parent == ckdir and partial.name.startswith(".step-00000030.pt.tmp"), name
    assert (
        partial.stat().st_size == int(size)
        and 65536 <= int(size) < (ckdir / "step-00000022.pt").stat().st_size / 2
    )
    with pytest.raises(Exception):
        torch.load(partial, weights_only=True)
    assert _step_files(run) == ["best.pt", "last.pt", "step-00000020.pt", "step-00000022.pt"]  # keep_last=2
    assert [load(ckdir / n)["loop"]["step"] for n in _step_files(run)] == [22, 22, 20, 22]  # all complete
    proc = run_cmd(cmd + ["resume=auto"], tmp_path, timeout=120)
    assert_ok(proc)
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "resumed from" in ln]
    assert len(said) == 1 and re.search(
        r"resumed from \S*last\.pt: 1 epoch\(s\), 22 step\(s\) done", said[0]
    ), said
    assert not any(".tmp" in p.name for p in ckdir.iterdir())
    ref = tmp_path / "ref"
    assert_ok(run_cmd([sys.executable, str(TRAIN), *SLOW, f"hydra.run.dir={ref}"], tmp_path, timeout=120))
    assert_same_checkpoint(ckdir / "last.pt", ref / "checkpoints" / "last.pt")
