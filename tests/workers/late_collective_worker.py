"""``train.py`` under torchrun whose process group is left while rank 0's last collective still runs: its
tensor, which Python no longer holds, is released by gloo's worker thread only once the other ranks join
the collective, 2 s after rank 0 left the group. The moment the CI run's hang was caught in (a worker still
releasing a finished collective's tensors as the group went), held open long enough to meet every time."""

import runpy
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddplab.runtime import group

LATE_S = 2.0  # rank 1's lateness: rank 0 reaches its exit's collection well within it
_leave = group.teardown


def teardown(clean: bool = True) -> None:
    if dist.is_initialized():
        late = dist.get_rank() != 0
        if late:
            time.sleep(LATE_S)
        work = dist.all_reduce(torch.ones(4), async_op=True)
        if late:
            work.wait()
        del work  # rank 0: only the work holds its tensor now, which Python must free (the GIL)
        clean = False  # no barrier, which would wait for the collective
    _leave(clean)


group.teardown = teardown
train = Path(__file__).resolve().parents[2] / "train.py"
sys.argv[0] = str(train)
runpy.run_path(str(train), run_name="__main__")
