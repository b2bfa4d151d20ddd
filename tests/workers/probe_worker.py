"""Run under torchrun with Hydra overrides as arguments: trains with two probes attached.

* a DDP communication hook that counts gradient all-reduces (per bucket);
* a recorder of the index batches each rank's sampler hands out, per epoch.

Rank 0 prints one JSON line: hook calls, optimizer steps, training forwards (micro-batches), and
every rank's per-epoch index lists.
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ddplab.config import register_configs
from ddplab.data import ShardedGlobalSampler
from ddplab.runtime import group
from ddplab.train.assemble import build_state
from ddplab.train.loop import Trainer

register_configs()
conf = Path(__file__).resolve().parents[2] / "conf"
with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
    cfg = compose(config_name="train", overrides=sys.argv[2:])
with open_dict(cfg):
    cfg.run_dir = sys.argv[1]

seen: dict[int, list[list[int]]] = {}
real_batches = ShardedGlobalSampler.batches


def recording_batches(self):
    b = real_batches(self)
    seen.setdefault(self.epoch, []).extend(b.tolist())
    return b


ShardedGlobalSampler.batches = recording_batches
state = group.init(cfg.distributed)
trainer = Trainer(build_state(cfg, state, Path(sys.argv[1])))
calls = {"n": 0}


def counting_hook(st, bucket):
    calls["n"] += 1
    return allreduce_hook(st, bucket)


trainer.state.model.register_comm_hook(None, counting_hook)
forwards = {"train": 0}


def count_forward(module, args):
    forwards["train"] += module.training  # evaluation forwards are not micro-batches


trainer.state.module.register_forward_pre_hook(count_forward)
out = trainer.fit()
everyone = [None] * state.world_size
dist.all_gather_object(everyone, {"rank": state.rank, "hook_calls": calls["n"], "seen": seen})
if state.is_main:
    print(
        "RESULT "
        + json.dumps(
            {
                "ranks": everyone,
                "steps": trainer.state.loop.step,
                "micro_batches": forwards["train"],
                "metrics": out,
            }
        ),
        flush=True,
    )
del trainer  # release DDP (and its reducer's threads) before the process group goes
group.teardown()
# Skip interpreter teardown: with a Python comm hook registered, destroying the
# gloo/reducer objects at shutdown occasionally aborts ("terminate called without
# an active exception", ~1 in 30 runs here) after all work is done.
sys.stdout.flush()
os._exit(0)
