"""checkpoint.async_save=true on 2 ranks under torchrun, a background write that fails or is interrupted: a
full disk on rank 0's write stops every rank at the same step with the write's own error and no partial file;
the launcher SIGTERMed or SIGKILLed during a write lets it complete, then the stop's own checkpoint follows
and resumes bitwise; FSDP's sharded async saves (DCP) resume to the synchronous run's end, and a disk too
small for them fails every rank in one line."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers.async_saves import ASYNC, _step_files
from helpers.compare import assert_same_checkpoint, load, result
from helpers.jobs import TRAIN, assert_ok, ranks, tmpfs, torchrun
from helpers.processes import finish, ranks_of, start, wait_for

pytestmark = pytest.mark.slow


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
    proc = start(cmd, tmp_path, log)
    wait_for(run / "provenance.json", proc, log)  # both ranks are up
    ranks = list(ranks_of(run, proc.pid).values())
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
