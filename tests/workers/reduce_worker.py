"""Run under torchrun: checks the packed reduction with unequal per-rank sample counts.

Prints one JSON line from rank 0: the reduced metrics and the number of
collectives the reduction issued.
"""

import json

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ddplab.runtime import group
from ddplab.task import ClassificationTask, TaskOutput
from ddplab.train.metrics import SumMeter, TrainMetrics

cfg = OmegaConf.create({"device": "cpu", "backend": "gloo", "init_method": "env://", "timeout_s": 60})
state = group.init(cfg)
r = state.rank

# Rank r holds 3 + 4r samples, each with loss r + 1 and correct iff label 0.
n = 3 + 4 * r
calls = {"n": 0}
real_all_reduce = dist.all_reduce


def counting_all_reduce(*a, **k):
    calls["n"] += 1
    return real_all_reduce(*a, **k)


dist.all_reduce = counting_all_reduce

logits = torch.zeros(n, 2)
logits[:, 0] = 1.0  # predicts class 0
target = torch.tensor([0] * (n - 1) + [1])  # one wrong per rank
task = ClassificationTask()
out = task(lambda x: logits, (None, target))
out = TaskOutput(torch.tensor(float(r + 1)), out.size, out.metrics)  # loss r + 1, accuracy from the real task
m = TrainMetrics(state, task.metric_names)
m.add_micro(out)
m.add_step(step_time=0.01 * (r + 1), data_time=0.001 * (r + 1))
train, _ = m.reduce()
train_calls = calls["n"]

meter = SumMeter(state.device, task.metric_names)
meter.update(out)
val = meter.reduce(state)
total_calls = calls["n"]

# Any named metrics ride in the same packed row, as (sum, count) given as device tensors or numbers:
# "hits" r of 2n per micro-batch (tensors), "bonus" 2(r + 1) per micro-batch counted once (numbers).
extra = TaskOutput(
    torch.tensor(1.0),
    n,
    {"hits": (torch.tensor(float(r)), torch.tensor(float(n))), "bonus": (2.0 * (r + 1), 1)},
)
m2 = TrainMetrics(state, ("hits", "bonus"))
m2.add_micro(extra)
m2.add_micro(extra)
m2.add_step(step_time=0.01, data_time=0.001)
train2, _ = m2.reduce()
meter2 = SumMeter(state.device, ("hits", "bonus"))
meter2.update(extra)
val2 = meter2.reduce(state)
if r == 0:
    print(
        "RESULT "
        + json.dumps(
            {
                "train": train,
                "val": val,
                "train_calls": train_calls,
                "total_calls": total_calls,
                "world": state.world_size,
                "train_named": train2,
                "val_named": val2,
                "named_calls": calls["n"] - total_calls,
            }
        ),
        flush=True,
    )
group.teardown()
