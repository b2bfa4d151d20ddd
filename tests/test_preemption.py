"""Preemption saves the work: SIGTERM / SIGINT / SIGUSR1 on any rank stop every rank at the same step,
after a checkpoint there, with ``result.json`` status ``preempted``; resume=auto continues bitwise.
Also: a self-launched job's stores listen on loopback only."""

from __future__ import annotations

import datetime
import json
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
from helpers import jobs
from helpers.compare import result
from helpers.jobs import TRAIN, assert_ok, job_env, read_scalars, run_cmd

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


def start(cmd: list[str], cwd: Path, log: Path, fresh: bool = False) -> subprocess.Popen:
    """Start in its own session (so a kill reaches torchrun's workers too), output to ``log``; forked from the
    job server where it allows (helpers.jobs.start), a real interpreter where ``fresh``."""
    with open(log, "w") as out:
        return jobs.start(cmd, cwd, out, subprocess.STDOUT, fresh=fresh)


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not path.exists():
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{path} never appeared (exit {proc.poll()})\n{log.read_text()[-4000:]}")
        time.sleep(0.02)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 60) -> float:
    """Seconds until the process exits."""
    t0 = time.monotonic()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running {timeout}s after the signal\n{log.read_text()[-4000:]}")
    return time.monotonic() - t0


def weights_and_momentum(run: Path) -> dict:
    ck = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return {
        **{f"model.{k}": v for k, v in ck["model"].items()},
        **{f"momentum.{i}": s["momentum_buffer"] for i, s in ck["optimizer"]["state"].items()},
    }


def children(pid: int) -> list[int]:
    """All descendants of ``pid`` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int(re.search(r"^PPid:\s+(\d+)", (d / "status").read_text(), re.M).group(1))
            except (OSError, AttributeError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def ranks_of(pid: int) -> dict[int, int]:
    """{RANK: pid} of the training ranks under ``pid`` (from their environment)."""
    ranks = {}
    for p in children(pid):
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{p}/environ").read_text().split("\0") if "=" in kv)
        if "RANK" in env:
            ranks[int(env["RANK"])] = p
    return ranks


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
    # ranks_of reads environ
    proc = start(TORCHRUN + SLOW + [f"hydra.run.dir={run}"], tmp_path, log, fresh=True)
    wait_for(run / "checkpoints" / "step-00000022.pt", proc, log)
    os.kill(ranks_of(proc.pid)[1], signal.SIGUSR1)
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


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask in /proc)."""
    try:
        mask = next(
            ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("SigCgt:")
        )
    except (OSError, StopIteration):
        return False
    return bool(int(mask.split()[1], 16) >> (sig - 1) & 1)


@pytest.mark.slow
def test_a_signal_during_start_up_is_not_fatal_and_the_job_checkpoints_at_its_first_step(tmp_path):
    """SLURM's time-limit warning (SIGUSR1) can come seconds after a (re)start, while Python still imports
    torch and Hydra (seen in CI: the job FAILED, killed by the signal's default action, and was never
    requeued). Now it is remembered; the job stops at its first agreed step with a checkpoint, as
    preempted."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), "model=mlp", "num_epochs=1", "progress=none", f"hydra.run.dir={run}"],
        cwd=tmp_path,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0 and not _catches(proc.pid, signal.SIGUSR1):
        time.sleep(0.002)
    assert not run.exists()  # still starting: Hydra has not made the run dir
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGUSR1, (proc.returncode, err[-3000:])
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "preempted" and result["step"] >= 1 and Path(result["checkpoint"]).is_file(), (
        result
    )
    said = re.search(
        r"SIGUSR1 received during start-up, ([\d.]+) s ago: stopping at the first step boundary",
        (run / "train.log").read_text(),
    )
    assert said and float(said.group(1)) > 0.1, said  # it came before the handler of the job existed


def test_the_start_up_hold_ends_when_the_job_handler_is_installed():
    """After the job, a SIGTERM acts as it would without ddplab: the job's handler restores the default, not
    the start-up hold (which would swallow a launcher's SIGTERM during teardown)."""
    from ddplab.runtime import signals

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signals.hold_during_startup()
        assert signal.getsignal(signal.SIGTERM) is signals._remember
        stop = signals.StopSignal().install()
        stop.uninstall()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("ends", ["stopped", "failed"])
def test_an_in_process_study_worker_leaves_no_hold_behind(monkeypatch, ends):
    """A study worker holds stop signals for its life (signals.hold_for_life). Run in-process (a notebook, a
    test, a sweep's next job), its hold outlived it: the next job's handler restored the hold instead of the
    default (CI at c386c65, test order changed). A signal the worker stopped on is spent; one it never acted
    on (it failed first) stays held, for the next job to stop at its first step, as after any start-up
    signal."""
    from helpers.jobs import compose_cfg

    import ddplab.study as study
    from ddplab.runtime import signals
    from ddplab.runtime.signals import Preempted

    def stopped_while_opening(worker):
        os.kill(os.getpid(), signal.SIGTERM)  # held, not fatal: the worker's hold is in place
        raise Preempted("SIGTERM", -1, None) if ends == "stopped" else RuntimeError("the storage said no")

    monkeypatch.setattr(study.StudyWorker, "open", stopped_while_opening)
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(Preempted if ends == "stopped" else RuntimeError):
            study.run_study(compose_cfg(["hparams_search=study", "model=mlp"]))
        assert (signals.held(), signals._FOR_LIFE) == (None if ends == "stopped" else "SIGTERM", [])
        assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)] == [
            signal.SIG_DFL
        ] * 3
    finally:
        signals._EARLY.clear()
        signal.signal(signal.SIGTERM, before)


SELF_LAUNCH_HANDLERS = """
import signal, sys
from pathlib import Path

def entry(job):
    return {"ok": 1.0}

if __name__ == "__main__":
    from ddplab.runtime.launch import launch
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)
    mine = lambda signum, frame: None
    signal.signal(signal.SIGUSR1, mine)
    before = {s: signal.getsignal(s) for s in sigs}
    Path(sys.argv[1]).mkdir()
    print("result", launch(entry, {}, 2, 0, Path(sys.argv[1])))
    print("changed", sorted(s.name for s in sigs if signal.getsignal(s) is not before[s]))
"""


def test_a_self_launch_gives_the_processes_signal_handlers_back(tmp_path):
    """torch's launch agent installs handlers that raise SignalException and never removes them: after a
    self-launched job a SIGTERM raised wherever the process was (a study worker between trials, in a storage
    call) instead of reaching the handler the process had. The launch puts every handler back."""
    script = tmp_path / "launch_twice.py"
    script.write_text(SELF_LAUNCH_HANDLERS)
    proc = run_cmd([sys.executable, str(script), str(tmp_path / "run")], tmp_path, timeout=120)
    assert_ok(proc)
    assert "result {'ok': 1.0}" in proc.stdout, proc.stdout[-2000:]
    assert "changed []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
