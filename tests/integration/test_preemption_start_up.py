"""Stop signals before and after a job's own handler: one during start-up (imports) is held and the job stops
at its first agreed step with a checkpoint, as preempted; the hold ends when the job's handler is installed;
an in-process study worker and a self-launch leave the process's signal handlers as they found them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.jobs import TRAIN, assert_ok, job_env, run_cmd

pytestmark = pytest.mark.dist


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
