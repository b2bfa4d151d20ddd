"""A rank (SLURM's task variables, no launcher's store) whose peer stops taking part after their first group:
it then waits to join a second group that will never form — as a study worker's rank does when rank 0 dies
between trials under torchrun (whose agent keeps the store up). Rank 0 keeps serving the store and sleeps;
rank 1 prints ``WAITING`` and waits; the test signals it there. Start-up holds stop signals as train.py does;
a Preempted exits 128 + the signal, as the CLI does."""

import os
import sys
import time

import torch.distributed as dist
from helpers.jobs import compose_cfg

from ddplab.runtime import group, signals
from ddplab.runtime.signals import Preempted

signals.hold_during_startup()
cfg = compose_cfg(["distributed.timeout_s=60"]).distributed
rank = int(os.environ["SLURM_PROCID"])
group.init(cfg)
dist.barrier()
group.teardown(clean=True)
if rank == 0:
    time.sleep(120)  # out of the job: the second group never forms (the test ends this process)
    sys.exit(0)
print("WAITING", flush=True)
t0 = time.monotonic()
try:
    group.init(cfg)
except Preempted as e:
    # when it left the wait, on the clock the test reads too (its exit, torch's teardown included, comes
    # after)
    print(f"LEFT after {time.monotonic() - t0:.1f}s at {time.time():.3f}: {e.signal_name}", flush=True)
    sys.exit(e.exit_code)
