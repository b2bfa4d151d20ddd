"""checkpoint.async_save=true: the loop pauses only to copy the state; a background thread writes it.
The files are the synchronous saves' bit for bit; a stop waits for the write in flight and then saves
its own step; a write killed half-way is never resumed; a full disk fails the run cleanly, every rank."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import toy
from helpers.compare import assert_same_checkpoint, load
from helpers.jobs import TRAIN, assert_ok, compose_cfg, ranks, run_cmd, tmpfs, torchrun
from test_preemption import finish, ranks_of, result, start, wait_for

import ddplab
from ddplab.checkpoint import files

pytestmark = pytest.mark.slow

ASYNC = ["checkpoint.async_save=true"]
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


def _step_files(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("*.pt"))


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


DDP2 = [
    "model=mlp",
    "model._target_=toy.SlowMLP",
    "+model.delay_s=0.1",
    "num_epochs=2",
    "log_every_n_steps=5",
    # 2 ranks, 44 steps of 0.1 s
    "checkpoint.every_n_steps=10",
    "progress=log",
    "distributed.timeout_s=30",
]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory) -> Path:
    """DDP2 uninterrupted, synchronous saves: its last.pt."""
    ref = tmp_path_factory.mktemp("ref")
    assert_ok(ranks(2, DDP2 + [f"hydra.run.dir={ref / 'run'}"], ref, timeout=240))
    return ref / "run" / "checkpoints" / "last.pt"


def _wait_gone(pids: list[int], timeout: float = 60) -> None:
    """Until none of ``pids`` runs (ranks orphaned by a killed torchrun agent: each is in a session of its
    own)."""

    def alive() -> list[int]:
        return [
            p
            for p in pids
            if Path(f"/proc/{p}").exists()
            and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
        ]

    t0 = time.monotonic()
    while alive() and time.monotonic() - t0 < timeout:
        time.sleep(0.1)
    left = alive()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} still running {timeout}s after their launcher died"


@pytest.mark.dist
def test_two_rank_ddp_async_full_disk_on_the_writer_stops_every_rank_with_the_write_error(tmp_path):
    """Rank 0's background write fills the disk: both ranks stop at the same step, before the next save,
    with the write's own error; result.json says failed; no partial file is left."""
    args = [
        "model=mlp",
        "num_epochs=1",
        "checkpoint.every_n_steps=10",
        "distributed.timeout_s=30",
        "progress=log",
    ]
    with tmpfs(tmp_path / "disk", "size=600k") as disk:
        run = disk / "run"  # room for the logs and events, not for the first checkpoint
        proc = torchrun(2, args + ASYNC + [f"hydra.run.dir={run}"], tmp_path, timeout=180)
        out, ckdir = proc.stdout + proc.stderr, run / "checkpoints"
        assert proc.returncode != 0, out[-4000:]
        said = {
            int(r): int(st)
            for r, st in re.findall(
                r"rank (\d)/2 failed in epoch 1, step (\d+): CheckpointWriteError: could not write "
                r"checkpoint "
                rf"{re.escape(str(ckdir))}/step-00000010\.pt: \w+: .*No space left on device",
                out,
            )
        }
        # Each rank raised the write's error itself (none was left to torchrun's kill), at the same step, by
        # the next save (step 20, said as 21) at the latest.
        assert said.keys() == {0, 1} and len(set(said.values())) == 1 and 11 <= said[0] <= 21, out[-4000:]
        assert [p.name for p in ckdir.iterdir() if p.suffix == ".pt" or ".tmp" in p.name] == []
        res = json.loads((run / "result.json").read_text())
        assert (
            res["status"] == "failed"
            and "step-00000010.pt" in res["error"]
            and "No space left on device" in res["error"]
        ), res


@pytest.mark.dist
@pytest.mark.xdist_group("async_ddp_reference")  # both cases on one worker: `ddp_reference` is built once
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_two_rank_ddp_async_launcher_signalled_during_a_background_write_saves_both_and_resumes_bitwise(
    tmp_path, ddp_reference, sig
):
    """torchrun's agent gets SIGTERM (passed on to the ranks) or SIGKILL (the ranks' launcher watch notices)
    while step 10's file is being written in the background (3 s): that write completes, the stop's own
    checkpoint follows it, last.pt is the stop's, and resume=auto from the dir ends bitwise."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    disk = [
        "+callbacks.disk._target_=toy.SlowDisk",
        "+callbacks.disk.delay_s=3",
        "+callbacks.disk.signal_at=10",
        f"+callbacks.disk.signal={sig}",
        "+callbacks.disk.to=launcher",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(TRAIN),
        *DDP2,
        *ASYNC,
        *disk,
        f"hydra.run.dir={run}",
    ]
    proc = start(cmd, tmp_path, log, fresh=True)  # ranks_of reads /proc/PID/environ
    wait_for(run / "provenance.json", proc, log)  # both ranks are up
    ranks = list(ranks_of(proc.pid).values())
    assert len(ranks) == 2, ranks
    finish(proc, log, timeout=120)
    _wait_gone(ranks)
    out, res = log.read_text(), result(run)
    why = "SIGTERM" if sig == "SIGTERM" else "launcher died"
    assert res["status"] == "preempted" and why in res["signal"], (res, out[-3000:])
    stop = res["step"]
    assert 10 < stop <= 30 and res["checkpoint"].endswith(f"step-{stop:08d}.pt"), res
    assert re.search(rf"checkpoint at step {stop} waited [\d.]+s for the previous background write", out), (
        out[-3000:]
    )
    ckdir = run / "checkpoints"
    assert {"last.pt", "step-00000010.pt", f"step-{stop:08d}.pt"} <= set(_step_files(run))
    assert not [p.name for p in ckdir.iterdir() if ".tmp" in p.name]
    assert [load(ckdir / n)["loop"]["step"] for n in ("step-00000010.pt", "last.pt")] == [10, stop]
    assert_ok(torchrun(2, DDP2 + ASYNC + ["resume=auto", f"hydra.run.dir={run}"], tmp_path, timeout=240))
    assert_same_checkpoint(ckdir / "last.pt", ddp_reference)


@pytest.mark.dist
def test_two_ranks_fsdp_async_matches_sync_and_a_full_disk_fails_every_rank(tmp_path):
    """FSDP's sharded checkpoints through DCP's async_save: the run resumes from the shards written in the
    background to the uninterrupted run's end; on a disk too small for them every rank fails with one line,
    no shards left."""
    fsdp = [
        "model=mlp",
        "num_epochs=1",
        "distributed=fsdp",
        "checkpoint.every_n_steps=10",
        "distributed.timeout_s=30",
    ]
    a, c = tmp_path / "async", tmp_path / "resumed"
    assert_ok(ranks(2, fsdp + ASYNC + [f"hydra.run.dir={a}"], tmp_path, timeout=180))
    assert sorted(p.name for p in (a / "checkpoints").glob("*.dcp")) == [
        "step-00000020.dcp",
        "step-00000022.dcp",
    ]
    # The shards written in the background resume (by their step file, synchronously) to the same end:
    # complete.
    assert_ok(
        ranks(
            2,
            fsdp + [f"hydra.run.dir={c}", f"resume={a / 'checkpoints' / 'step-00000020.pt'}"],
            tmp_path,
            timeout=180,
        )
    )
    val = {r: json.loads((r / "result.json").read_text())["metrics"]["val/loss"] for r in (a, c)}
    assert val[a] == val[c], val

    with tmpfs(tmp_path / "disk", "size=600k") as disk:
        run = disk / "run"  # room for the logs and events, not for the first checkpoint's ~0.6 MB of shards
        proc = torchrun(2, fsdp + ASYNC + [f"hydra.run.dir={run}"], tmp_path, timeout=180)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        # Said on every rank at the same step, before the run goes past its next save (step 20).
        said = {
            int(r): int(st)
            for r, st in re.findall(
                r"rank (\d)/2 failed in epoch 1, step (\d+): CheckpointWriteError: could not write sharded "
                r"checkpoint "
                rf"{re.escape(str(run / 'checkpoints'))}/step-00000010\.dcp",
                out,
            )
        }
        assert said.keys() == {0, 1} and len(set(said.values())) == 1 and 11 <= said[0] <= 21, out[-4000:]
        assert [p.name for p in (run / "checkpoints").iterdir() if p.name.endswith(".dcp")] == []
        assert json.loads((run / "result.json").read_text())["status"] == "failed"
