"""Run under torchrun with Hydra overrides: build ddplab's Trainer, report how the strategy wrapped
the model (from DDP's own logging data, not ddplab's description), train, and list the checkpoint's keys.

Rank 0 prints one JSON line.
"""

import json
import os
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from ddplab.config import register_configs
from ddplab.runtime import group
from ddplab.train.assemble import build_state
from ddplab.train.loop import Trainer

register_configs()
with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
    cfg = compose(config_name="train", overrides=sys.argv[2:])
with open_dict(cfg):
    cfg.run_dir = sys.argv[1]
state = group.init(cfg.distributed)
trainer = Trainer(build_state(cfg, state, Path(sys.argv[1])))
ddp = trainer.state.model
data = ddp._get_ddp_logging_data()
inner = ddp.module
report = {
    "wrapper": type(ddp).__name__,
    "inner": type(inner).__name__,
    # compile came first: DDP wraps the compiled module, which wraps the plain one the checkpoints use
    "compiled_wraps_plain_module": getattr(inner, "_orig_mod", None) is trainer.state.module,
    "static_graph": bool(data.get("static_graph")),
    "bucket_cap_bytes": int(data.get("bucket_cap_bytes", -1)),
    "comm_hook": data.get("comm_hook", ""),
}
out = trainer.fit()
report["val_acc"] = out["val/acc"]
report["losses"] = [out["train/loss"]]
if state.is_main:
    ck = torch.load(Path(sys.argv[1]) / "checkpoints" / "last.pt", weights_only=True)
    report["checkpoint_keys"] = sorted(ck["model"])
    report["module_keys"] = sorted(trainer.state.module.state_dict())
    print("RESULT " + json.dumps(report), flush=True)
del trainer, ddp, inner  # release DDP before the process group goes
group.teardown()
sys.stdout.flush()
os._exit(0)  # as probe_worker: skip interpreter teardown with a comm hook registered
