"""Run under torchrun: checks the packed reduction with unequal per-rank sample counts.

Prints one JSON line from rank 0: the reduced metrics and the number of
collectives the reduction issued.
"""

import json

import torch
import torch.distributed as dist

from ddplab import distributed
from ddplab.metrics import SumMeter, TrainMetrics, reduce_eval
from omegaconf import OmegaConf

cfg = OmegaConf.create({"device": "cpu", "backend": "gloo", "init_method": "env://", "timeout_s": 60})
state = distributed.setup(cfg)
r = state.rank

# Rank r holds 3 + 4r samples, each with loss r + 1 and correct iff label 0.
n = 3 + 4 * r
calls = {"n": 0}
real_all_reduce = dist.all_reduce


def counting_all_reduce(*a, **k):
    calls["n"] += 1
    return real_all_reduce(*a, **k)


dist.all_reduce = counting_all_reduce

m = TrainMetrics(state)
logits = torch.zeros(n, 2)
logits[:, 0] = 1.0  # predicts class 0
target = torch.tensor([0] * (n - 1) + [1])  # one wrong per rank
m.add_micro(torch.tensor(float(r + 1)), logits, target)
m.add_step(step_time=0.01 * (r + 1), data_time=0.001 * (r + 1))
train = m.reduce()
train_calls = calls["n"]

meter = SumMeter(state.device)
meter.update(torch.tensor(float(r + 1)), logits, target)
val = reduce_eval(meter, state)
if r == 0:
    print("RESULT " + json.dumps({"train": train, "val": val, "train_calls": train_calls,
                                  "total_calls": calls["n"], "world": state.world_size}), flush=True)
distributed.teardown()
