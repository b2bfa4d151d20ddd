"""DataParallel vs DistributedDataParallel throughput on one multi-GPU machine.

    python scripts/bench_dp_vs_ddp.py                       # all visible GPUs, resnet18, 32x32 synthetic
    python scripts/bench_dp_vs_ddp.py --image-size 224 --batch-size 256 --amp

The comparison the multi-GPU tutorials make: ``distributed=dp`` is one process
that scatters each batch over the GPUs and gathers the outputs on GPU 0;
``distributed=ddp`` is one process per GPU (torchrun), each with its own
shard of the batch, gradients all-reduced. Same model, data and global batch;
images/s is ``vitals/samples_per_s`` (median over log intervals, the first left
out as warm-up). Needs at least 2 GPUs; with fewer it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _train_runs import REPO, train_throughput


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=None, help="default: all visible")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=512, help="global batch")
    p.add_argument("--num-train", type=int, default=25600)
    p.add_argument("--amp", action="store_true")
    a = p.parse_args()

    import torch

    gpus = a.gpus or torch.cuda.device_count()
    if gpus < 2 or torch.cuda.device_count() < gpus:
        print(
            f"bench_dp_vs_ddp: needs at least 2 GPUs, this machine has {torch.cuda.device_count()}; "
            "nothing to compare (skipped)."
        )
        return
    common = [
        f"model={a.model}",
        "dataset=synthetic",
        f"dataset.num_train={a.num_train}",
        "dataset.num_val=512",
        f"dataset.image_size={a.image_size}",
        f"batch_size={a.batch_size}",
        "num_epochs=2",
        "progress=none",
        f"amp={str(a.amp).lower()}",
        "log_every_n_steps=10",
    ]
    train = str(REPO / "train.py")
    with tempfile.TemporaryDirectory(prefix="ddplab-dp-ddp-") as work:
        env_gpus = ",".join(map(str, range(gpus)))
        gpu_env = ["env", f"CUDA_VISIBLE_DEVICES={env_gpus}", sys.executable]
        dp = train_throughput([*gpu_env, train, "distributed=dp", *common], Path(work) / "dp")
        ddp = train_throughput(
            [
                *gpu_env,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={gpus}",
                train,
                *common,
            ],
            Path(work) / "ddp",
        )
    print(
        f"| {a.model}, {a.image_size}x{a.image_size}, global batch {a.batch_size}, {gpus} GPUs | images/s |"
    )
    print("|---|---|")
    print(f"| DataParallel (1 process) | {dp:,.0f} |")
    print(f"| DistributedDataParallel ({gpus} processes) | {ddp:,.0f} ({ddp / dp:.2f}x) |")


if __name__ == "__main__":
    main()
