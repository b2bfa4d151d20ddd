"""Run ``train.py ARGS`` under torchrun with counters on every rank:

* every public ``torch.distributed`` collective (DDP's own gradient all-reduce
  runs inside its C++ reducer and its buffer broadcast through a private
  helper, so what is counted here is exactly what ddplab adds);
* every Python-level read of a tensor's value on the host (``item``,
  ``tolist``, ``bool``/``float``/``int``, ``numpy``, ``cpu``): each is a
  host-device sync on a GPU;
* with CUDA, also the syncs ``torch.cuda.set_sync_debug_mode("warn")`` reports;
* the stop agreement's checks (``StopAgreement._check``), and when each step ended.

An optimizer-step hook snapshots the counters at every step; each rank writes
the per-step deltas as JSON to ``$COUNT_OUT.<rank>``.
"""

import json
import os
import runpy
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

counts = {"collectives": 0, "syncs": 0, "cuda_syncs": 0, "stop_checks": 0}
COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
]
HOST_READS = ["item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu"]


def counting(fn, key):
    def wrapper(*a, **k):
        counts[key] += 1
        return fn(*a, **k)

    return wrapper


for name in COLLECTIVES:
    if hasattr(dist, name):
        setattr(dist, name, counting(getattr(dist, name), "collectives"))
for name in HOST_READS:
    setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), "syncs"))

# The stop agreement's own checks (one tiny collective about once a second, outside log steps) are counted
# apart, so the tests can hold them to exactly that budget.
from ddplab.runtime.stopping import StopAgreement  # noqa: E402

StopAgreement._check = counting(StopAgreement._check, "stop_checks")

if torch.cuda.is_available():
    torch.cuda.set_sync_debug_mode("warn")
    _show = warnings.showwarning

    def show(message, category, *a, **k):
        if "synchroniz" in str(message):
            counts["cuda_syncs"] += 1
        else:
            _show(message, category, *a, **k)

    warnings.showwarning = show
    warnings.simplefilter("always")

steps: list[dict[str, int]] = []
last = dict(counts)


def on_step(*_):
    global last
    steps.append({**{k: counts[k] - last[k] for k in counts}, "t": time.perf_counter()})
    last = dict(counts)


register_optimizer_step_post_hook(on_step)
train = Path(__file__).resolve().parents[2] / "train.py"
sys.argv = [str(train), *sys.argv[1:]]
try:
    runpy.run_path(str(train), run_name="__main__")
finally:
    Path(f"{os.environ['COUNT_OUT']}.{os.environ.get('RANK', '0')}").write_text(json.dumps(steps))
