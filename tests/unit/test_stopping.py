"""StopAgreement in one process: its checks are spaced by time (~1 s of the slowest rank's steps), not steps;
a rank stopped by its peers whose own launcher is dead says the launcher died."""

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
