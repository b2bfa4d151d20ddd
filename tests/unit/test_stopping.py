"""Preemption off the millisecond path: a stop is agreed within seconds at any step time and any log
interval, during a long evaluation too, and a rank whose launcher died stops instead of training on."""

from __future__ import annotations

import os

from ddplab.runtime.group import Dist
from ddplab.runtime.signals import StopSignal
from ddplab.runtime.stopping import StopAgreement


def test_cadence_spaces_checks_by_time_not_steps():
    """Unit: the next check is ~1 s of steps away, measured from the slowest rank; nothing in between."""
    agreement = StopAgreement(StopSignal(), Dist(), period_s=1.0)
    # exercise the multi-rank cadence (one process: the "collective" is the row itself)
    agreement.alone = False
    c = agreement._train
    # pretend: step 1 took 0.25 s (and a bit); its check comes at once: 3 such steps fit in 1 s
    c.since -= 0.25
    agreement.after_step()
    assert agreement.checks == 1 and c.interval == 3
    for _ in range(2):
        agreement.after_step()
    assert agreement.checks == 1  # steps 2-3: nothing
    c.since -= 3 * 0.002  # 3 steps of 2 ms → about 500 steps per second
    agreement.after_step()
    assert agreement.checks == 2 and 400 <= c.interval <= 500
    agreement.signal.request("test")
    for _ in range(c.interval - 1):
        assert not agreement.after_step()
    assert agreement.after_step() and agreement.agreed  # the request is heard at the next check
    # A log step's collective carries the flag: it restarts the count.
    assert agreement.heard_at_log_step(False) and c.left == c.interval


def test_a_rank_stopped_by_its_peers_whose_own_launcher_is_dead_says_the_launcher_died():
    """Unit: the stop agreement can carry another rank's flag before this rank's once-a-second launcher watch
    has polled; the reason then comes from this rank's launcher itself, not "a signal to another rank" (CI saw
    rank 0 write that after torchrun was killed: rank 1's watch had noticed first)."""
    gone = 2**22 + 17  # not this process's parent
    agreement = StopAgreement(StopSignal(), Dist())
    agreement.signal._launcher = os.getppid()
    assert agreement.reason == "a signal to another rank"  # its launcher alive: the stop came from a peer
    agreement.signal._launcher = gone
    assert agreement.reason == f"launcher died (pid {gone})"


def test_under_slurm_the_grace_is_its_killwait_and_the_shortest_grace_wins(tmp_path, monkeypatch):
    """SLURM's KillWait (scontrol show config), not an assumed 30 s; torchrun inside a SLURM job: the shorter
    of the two; SLURM's default when scontrol cannot answer."""
    from ddplab.runtime import env

    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(
        "#!/bin/sh\necho 'JobCompType             = jobcomp/none'\necho 'KillWait                = 12 sec'\n"
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}")
    for key in ("TORCHELASTIC_RUN_ID", "KUBERNETES_SERVICE_HOST", env.SELF_LAUNCHED):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    env.slurm_kill_wait_s.cache_clear()
    try:
        assert env.launcher_grace_s() == 12.0
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun's 30 s inside SLURM's 12 s
        assert env.launcher_grace_s() == 12.0
        scontrol.write_text("#!/bin/sh\nexit 1\n")
        env.slurm_kill_wait_s.cache_clear()
        assert env.launcher_grace_s() == 30.0
        monkeypatch.delenv("SLURM_JOB_ID")
        assert env.launcher_grace_s() == 30.0
        monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")  # torchrun --shutdown-timeout 7
        assert env.launcher_grace_s() == 7.0
        monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")  # not a number: torchrun's default
        assert env.launcher_grace_s() == 30.0
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        assert env.launcher_grace_s() is None
    finally:
        env.slurm_kill_wait_s.cache_clear()
