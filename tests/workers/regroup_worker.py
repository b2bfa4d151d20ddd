"""A rank whose job forms several process groups in turn (as a study worker does: one per agreement, one per
trial), with SLURM's task variables and no launcher's store: rank 0 serves the rendezvous store itself. Rank 0
lets go of each group's store half a second after the others have left the group (a busy or descheduled rank
0, as the soak met under srun). Prints ``RESULT ok`` when every group formed and reduced."""

import os
import time

import torch
import torch.distributed as dist
from helpers.jobs import compose_cfg

from ddplab.runtime import group

cfg = compose_cfg(["distributed.timeout_s=15"]).distributed
if int(os.environ["SLURM_PROCID"]) == 0:
    destroy = dist.destroy_process_group

    def slowly(*args, **kw):
        held = dist.distributed_c10d._get_default_store()  # the group's store, alive a while after the group
        destroy(*args, **kw)
        time.sleep(0.5)
        del held

    dist.destroy_process_group = slowly
for _ in range(4):
    group.init(cfg)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2, t
    group.teardown(clean=True)
print("RESULT ok", flush=True)
