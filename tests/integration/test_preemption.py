"""Preemption of a running job saves the work: SIGTERM / SIGINT / SIGUSR1 on any rank stop every rank at the
same step, after a checkpoint there, with ``result.json`` status ``preempted``; resume=auto continues bitwise;
a second signal exits at once, and one after the last checkpoint lets the job complete.
Also: a self-launched job's stores listen on loopback only (plain torchrun's on every interface)."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.compare import result
from helpers.jobs import TRAIN, assert_ok, read_scalars, run_cmd
from helpers.processes import finish, ranks_of, start, wait_for
from helpers.proctree import children

pytestmark = pytest.mark.dist

# 22 steps/epoch on digits; each training forward sleeps 10 ms, so a run lasts long enough to be signalled.
SLOW = [
    "model=mlp",
    "model._target_=toy.SlowMLP",
    "+model.delay_s=0.01",
    "num_epochs=6",
    "log_every_n_steps=5",
    "progress=log",
]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN)]


def weights_and_momentum(run: Path) -> dict:
    ck = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return {
        **{f"model.{k}": v for k, v in ck["model"].items()},
        **{f"momentum.{i}": s["momentum_buffer"] for i, s in ck["optimizer"]["state"].items()},
    }


def listeners(pids: list[int]) -> list[str]:
    """Local addresses of the TCP listening sockets these processes hold (``ss -ltnp``)."""
    ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in ss.splitlines() if any(f"pid={p}," in line for p in pids)]


def test_sigterm_to_torchrun_checkpoints_every_rank_at_one_step_and_resume_is_bitwise(tmp_path):
    """What SLURM and Kubernetes do: SIGTERM to torchrun's agent, which forwards it to the ranks."""
    run, ref, log = tmp_path / "run", tmp_path / "ref", tmp_path / "run.log"
    proc = start(TORCHRUN + SLOW + [f"hydra.run.dir={run}"], tmp_path, log)
    wait_for(run / "checkpoints" / "step-00000022.pt", proc, log)  # epoch 1 done: mid-run
    proc.send_signal(signal.SIGTERM)
    took = finish(proc, log)
    out = log.read_text()
    assert proc.returncode != 0, out[-3000:]
    assert took < 10, took  # within the grace period a cluster gives
    res = result(run)
    assert res["status"] == "preempted" and res["signal"] == "SIGTERM", res
    stop = res["step"]
    assert 22 < stop < 6 * 22 and res["checkpoint"].endswith(f"step-{stop:08d}.pt")
    assert Path(res["checkpoint"]).is_file()
    # Both ranks stopped at that step; the signal was acted on within one log interval (5 steps).
    assert re.findall(r"preempted: stopped by .* at step (\d+)", out) == [str(stop)] * 2, out[-3000:]
    logged_before = [
        int(s) for s in re.findall(r"step (\d+)/\d+  loss", out[: out.index("SIGTERM received")])
    ]
    assert stop - max(logged_before) <= 5, (stop, logged_before)

    assert_ok(run_cmd(TORCHRUN + SLOW + [f"hydra.run.dir={run}", "resume=auto"], tmp_path, timeout=180))
    assert result(run)["status"] == "completed"
    assert_ok(run_cmd(TORCHRUN + SLOW + [f"hydra.run.dir={ref}"], tmp_path, timeout=180))
    a, b = weights_and_momentum(run), weights_and_momentum(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bitwise
    # One TensorBoard history: each step logged once, with the uninterrupted run's values.
    s, r = read_scalars(run / "tb")["train/loss"], read_scalars(ref / "tb")["train/loss"]
    assert s == r and len({st for st, _ in s}) == len(s)


def test_sigusr1_to_one_rank_stops_all_ranks_at_the_same_step(tmp_path):
    """A signal that reaches one rank only (SLURM's --signal=USR1 to a task, a user's kill)."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(TORCHRUN + SLOW + [f"hydra.run.dir={run}"], tmp_path, log)
    wait_for(run / "checkpoints" / "step-00000022.pt", proc, log)
    os.kill(ranks_of(run, proc.pid)[1], signal.SIGUSR1)
    took = finish(proc, log)
    out = log.read_text()
    assert took < 10 and proc.returncode != 0
    res = result(run)
    assert res["status"] == "preempted" and Path(res["checkpoint"]).is_file()
    assert sorted(re.findall(r"preempted: stopped by (.*) at step (\d+)", out)) == [
        ("SIGUSR1", str(res["step"])),
        ("a signal to another rank", str(res["step"])),
    ], out[-3000:]


def test_sigint_stops_a_single_process_with_a_checkpoint_and_exit_code_130(tmp_path):
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = start([sys.executable, str(TRAIN), *SLOW, f"hydra.run.dir={run}"], tmp_path, log)
    wait_for(run / "checkpoints" / "step-00000022.pt", proc, log)
    proc.send_signal(signal.SIGINT)
    took = finish(proc, log)
    assert proc.returncode == 130 and took < 10, log.read_text()[-3000:]
    res = result(run)
    assert res["status"] == "preempted" and res["signal"] == "SIGINT"
    ck = torch.load(res["checkpoint"], map_location="cpu", weights_only=True)
    assert ck["loop"]["step"] == res["step"] > 22  # the stop step itself is saved: nothing lost
    assert "KeyboardInterrupt" not in log.read_text()


def test_a_second_signal_exits_at_once_without_a_checkpoint(tmp_path):
    run, log = tmp_path / "run", tmp_path / "run.log"
    # 3 s per training forward: the graceful stop would wait for the step to end.
    args = ["model=mlp", "model._target_=toy.SlowMLP", "+model.delay_s=3", "num_epochs=1", "progress=log"]
    proc = start([sys.executable, str(TRAIN), *args, f"hydra.run.dir={run}"], tmp_path, log)
    t0 = time.monotonic()
    while "data: " not in log.read_text():  # the loop is about to start
        assert proc.poll() is None and time.monotonic() - t0 < 60, log.read_text()
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.2)
    assert proc.poll() is None  # still inside the 3 s step: the first signal waits for its end
    proc.send_signal(signal.SIGTERM)
    finish(proc, log, timeout=10)
    assert proc.returncode == 143, (proc.returncode, log.read_text()[-2000:])
    assert "exiting now, without a checkpoint" in log.read_text()
    # At once: before the 3 s step the first signal waits for could end (2.5 s after it), by train.log's clock
    # (the test's own wall clock would count the interpreter's exit and a loaded machine's scheduling).
    stamps = [
        datetime.datetime.strptime(m, "%Y-%m-%d %H:%M:%S,%f")
        for m in re.findall(
            r"^\[([\d-]+ [\d:]+,\d+)\].*(?:SIGTERM received|second signal)",
            (run / "train.log").read_text(),
            re.M,
        )
    ]
    assert len(stamps) == 2 and (stamps[1] - stamps[0]).total_seconds() < 2.5, stamps
    assert not list((run / "checkpoints").glob("step-*.pt")) if (run / "checkpoints").exists() else True


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")
def test_self_launched_job_listens_on_loopback_only_and_stops_on_sigterm(tmp_path):
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(
        [sys.executable, str(TRAIN), *SLOW, "distributed.nproc_per_node=2", f"hydra.run.dir={run}"],
        tmp_path,
        log,
    )
    wait_for(run / "checkpoints" / "step-00000022.pt", proc, log)
    addrs = listeners([proc.pid, *children(proc.pid)])
    # The rendezvous store, the ranks' store (both in the parent) and gloo's sockets (in the ranks).
    assert len(addrs) >= 3 and all(a.startswith("127.0.0.1:") for a in addrs), addrs
    proc.send_signal(signal.SIGTERM)
    took = finish(proc, log)
    assert proc.returncode == 143 and took < 10, log.read_text()[-3000:]
    res = result(run)
    assert res["status"] == "preempted" and Path(res["checkpoint"]).is_file(), res


def test_self_launch_parent_forwards_sigusr1_to_its_ranks(tmp_path):
    """SLURM's time-limit warning (--signal=USR1@N) reaches the process srun started: here, the parent."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(
        [sys.executable, str(TRAIN), *SLOW, "distributed.nproc_per_node=2", f"hydra.run.dir={run}"],
        tmp_path,
        log,
    )
    wait_for(run / "checkpoints" / "step-00000022.pt", proc, log)
    proc.send_signal(signal.SIGUSR1)
    finish(proc, log)
    out, res = log.read_text(), result(run)
    assert proc.returncode == 138 and res["status"] == "preempted" and res["signal"] == "SIGUSR1", (
        res,
        out[-3000:],
    )
    assert (
        re.findall(r"preempted: stopped by (\S+) at step (\d+)", out) == [("SIGUSR1", str(res["step"]))] * 2
    )


def test_a_signal_to_the_whole_job_after_its_last_checkpoint_lets_it_complete_and_exit_at_once(tmp_path):
    """Found by the soak (seed 155076137): self-launch, SIGINT to every process during the last checkpoint.
    The job completed, but torch's agent, shutting down on the signal, never read the ranks' results: they
    waited out its 30 s grace, were SIGKILLed, and the job exited 130 with result.json 'completed'."""
    run, log, stamp = tmp_path / "run", tmp_path / "run.log", tmp_path / "signalled"
    proc = start(
        [
            sys.executable,
            str(TRAIN),
            "model=mlp",
            "num_epochs=1",
            "progress=log",
            "distributed.nproc_per_node=2",
            "+callbacks.sig._target_=toy.SignalJobAtLastSave",
            "+callbacks.sig.last=22",
            f"+callbacks.sig.stamp={stamp}",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
        log,
    )
    finish(proc, log, timeout=90)
    gone = time.time()
    out = log.read_text()
    assert stamp.exists(), out[-3000:]
    assert proc.returncode == 0 and result(run)["status"] == "completed", (proc.returncode, out[-3000:])
    assert gone - float(stamp.read_text()) < 15, (gone - float(stamp.read_text()), out[-3000:])  # was 30.7 s
    assert "forcefully exiting via 9" not in out, out[-3000:]


def test_a_rank_dying_at_exit_after_a_preemption_leaves_the_job_preempted(tmp_path):
    """Every rank checkpointed and rank 0 recorded the stop; then rank 1 dies of SIGABRT as its interpreter
    exits (seen once in the soak). The job was preempted, its checkpoint whole: that is what the self-launch
    parent says, records and exits with, naming the rank that died afterwards."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(
        [
            sys.executable,
            str(TRAIN),
            *SLOW,
            "model._target_=toy.AbortAtExitMLP",
            f"+model.pid_dir={tmp_path}",
            "distributed.nproc_per_node=2",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
        log,
    )
    wait_for(run / "checkpoints" / "step-00000022.pt", proc, log)
    # To a rank (as SLURM's warning comes), not to the parent: the parent learns the outcome from exit codes.
    os.kill(int((tmp_path / "rank0.pid").read_text()), signal.SIGUSR1)
    finish(proc, log)
    out = log.read_text()
    res = result(run)
    assert proc.returncode == 138 and res["status"] == "preempted", (proc.returncode, res, out[-3000:])
    assert Path(res["checkpoint"]).is_file() and res["step"] > 22, res
    assert re.search(r"rank 1 (\(local 1\) exited )?with (code )?-6", out), out[-3000:]
    # Resumed without the dying model (the same numbers, another class): a change the guard must be told of.
    assert_ok(
        run_cmd(
            [
                sys.executable,
                str(TRAIN),
                *SLOW,
                "distributed.nproc_per_node=2",
                f"hydra.run.dir={run}",
                "resume=auto",
                "resume_apply_changes=true",
            ],
            tmp_path,
            timeout=180,
        )
    )
    assert result(run)["status"] == "completed"


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")
def test_plain_torchrun_standalone_store_listens_on_every_interface(tmp_path):
    """torch's limit, documented in docs/security.md: torchrun's agent builds its TCPStore
    itself, on the wildcard address, and offers no option to bind it. If this starts failing, torch
    binds loopback now: update docs/security.md."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(TORCHRUN + SLOW + [f"hydra.run.dir={run}"], tmp_path, log)
    try:
        wait_for(run / "checkpoints" / "step-00000022.pt", proc, log)
        agent = listeners([proc.pid])
        assert any(a.startswith(("*:", "0.0.0.0:", "[::]:")) for a in agent), agent
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
