"""Training samples/s of the data paths: DataLoader per sample vs tensors on the device, batched.

    python scripts/bench_data.py                      # digits and synthetic, CPU, 1 rank
    python scripts/bench_data.py --nproc 2 --device cuda

"before" is what a DataLoader does (``perf.data_on_device=false``): per-sample
``__getitem__``, augmentation per sample, collate, copy. "after" is ddplab's
default: the dataset lives on the training device, each batch is one index
op, and random crop + flip run on the whole batch. The default model is the
small MLP, so that the data path, not the convolutions, sets the pace (as it
does on a GPU). Each row is ``train.py``
run end to end; samples/s is ``vitals/samples_per_s`` (median over log
intervals, the first one left out as warm-up), read back from TensorBoard.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _train_runs import REPO, train_throughput

CASES = {
    "digits": ["dataset=digits", "num_epochs=3"],
    "digits + crop/flip": [
        "dataset=digits",
        "num_epochs=3",
        "dataset.augment.crop_padding=1",
        "dataset.augment.hflip=true",
    ],
    "synthetic 3x32x32": ["dataset=synthetic", "dataset.num_train=8192", "num_epochs=1"],
    "synthetic 3x32x32 + crop/flip": [
        "dataset=synthetic",
        "dataset.num_train=8192",
        "num_epochs=1",
        "dataset.augment.crop_padding=4",
        "dataset.augment.hflip=true",
    ],
}
PATHS = {
    "before (DataLoader)": ["perf.data_on_device=false"],
    "after (on device)": ["perf.data_on_device=true"],
}


def samples_per_s(args: list[str], nproc: int, work: Path) -> float:
    run_dir = work / f"run{len(list(work.iterdir()))}"
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    )
    return train_throughput([*launcher, str(REPO / "train.py"), *args, "progress=none"], run_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell (median reported)")
    p.add_argument("--model", default="mlp", help="small by default, so the data path is what is measured")
    p.add_argument("--extra", nargs="*", default=[], help="more train.py overrides for every run")
    a = p.parse_args()
    extra = [f"model={a.model}", f"distributed.device={a.device}", *a.extra]
    print(f"| data ({a.nproc} rank(s), {a.device}) | " + " | ".join(PATHS) + " | speed-up |")
    print("|---" * (len(PATHS) + 2) + "|")
    with tempfile.TemporaryDirectory(prefix="ddplab-bench-data-") as work:
        for name, case in CASES.items():
            rates = []
            for path_args in PATHS.values():
                runs = [
                    samples_per_s(case + path_args + extra, a.nproc, Path(work)) for _ in range(a.repeats)
                ]
                rates.append(statistics.median(runs))
            print(
                f"| {name} | " + " | ".join(f"{r:,.0f}" for r in rates) + f" | {rates[1] / rates[0]:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
