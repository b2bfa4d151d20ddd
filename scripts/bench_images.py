"""Image files at the speed of a hand-written pipeline? ``dataset=imagefolder``'s loader against a
best-practice hand-written DataLoader, side by side, on a generated set of JPEGs.

Both decode the same files the same way (Pillow: RGB, short side resized to ``--image-size``, centre
crop, normalised) in the same number of worker processes with the same ``prefetch_factor``. The
hand-written one is what a careful user writes: ``shuffle``, ``pin_memory`` (on CUDA),
``persistent_workers``, ``prefetch_factor`` (``--prefetch``), ``drop_last``. ddplab's is its own
``TrainLoader`` over ``ddplab.data.imagefolder`` with the sampler a training run uses. Epochs alternate
between the two in one process (the machine's speed drifts over minutes); each figure is the median
over epochs, the first epoch of each left out (workers start).

    python scripts/bench_images.py                               # 2,048 JPEGs 320x240 -> 128, 2 workers
    python scripts/bench_images.py --images 1024 --source-size 500 375 --image-size 224
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddplab.data import ShardedGlobalSampler, TrainLoader, imagefolder  # noqa: E402


def make_images(root: Path, n: int, classes: int, size: tuple[int, int]) -> None:
    """JPEGs of smooth gradients plus noise (photo-like sizes: ~15-25 KB at 320x240), n/classes a class."""
    from PIL import Image

    rng = np.random.default_rng(0)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    for split, count in (("train", n), ("val", max(classes, n // 8))):
        for i in range(count):
            d = root / split / f"c{i % classes}"
            d.mkdir(parents=True, exist_ok=True)
            base = (xx * rng.uniform(0.2, 1.0) + yy * rng.uniform(0.2, 1.0))[..., None] * rng.uniform(
                0.3, 1, 3
            )
            img = np.clip(base % 256 + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(d / f"{i:06d}.jpg", quality=90)


class HandImages(Dataset):
    """The hand-written dataset: the same files, the same decode, as a user would write it."""

    def __init__(self, root: Path, size: int):
        classes = sorted(p.name for p in root.iterdir())
        self.files = [(p, c) for c, name in enumerate(classes) for p in sorted((root / name).iterdir())]
        self.size = size
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.files[i]
        with Image.open(path) as im:
            im = im.convert("RGB")
            w, h = im.size
            s = self.size / min(w, h)
            im = im.resize((max(self.size, round(w * s)), max(self.size, round(h * s))), Image.BILINEAR)
            w, h = im.size
            left, top = (w - self.size) // 2, (h - self.size) // 2
            im = im.crop((left, top, left + self.size, top + self.size))
            x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (x - self.mean) / self.std, torch.tensor(label)


def loaders(root: Path, args: argparse.Namespace) -> dict[str, object]:
    cpu = torch.device("cpu")
    hand = DataLoader(
        HandImages(root / "train", args.image_size),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=torch.cuda.is_available(),
        drop_last=True,
        persistent_workers=args.workers > 0,
        prefetch_factor=args.prefetch if args.workers else None,
    )
    data = imagefolder(str(root), image_size=args.image_size)
    sampler = ShardedGlobalSampler(len(data.train), args.batch_size, 1, 0, seed=0)
    ours = TrainLoader(
        data.train, sampler, cpu, num_workers=args.workers, pin_memory=True, prefetch_factor=args.prefetch
    )  # perf.prefetch_factor
    return {"hand-written DataLoader": hand, "ddplab imagefolder": ours}


def epoch_rate(loader, epoch: int) -> float:
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    t0, n = time.perf_counter(), 0
    for x, _ in loader:
        n += len(x)
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--source-size", type=int, nargs=2, default=[320, 240])
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--prefetch", type=int, default=4, help="prefetch_factor of both (ddplab: perf.prefetch_factor)"
    )
    p.add_argument("--epochs", type=int, default=6, help="per side, the first left out")
    args = p.parse_args()
    torch.set_num_threads(1)  # the main process only collates and hands over: leave the cores to the workers
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        make_images(root, args.images, args.classes, tuple(args.source_size))
        kb = sum(f.stat().st_size for f in (root / "train").rglob("*.jpg")) / args.images / 1024
        sides = list(loaders(root, args).items())  # made once: persistent workers stay up, as in training
        rates: dict[str, list[float]] = {name: [] for name, _ in sides}
        for epoch in range(args.epochs):
            for name, loader in sides if epoch % 2 else sides[::-1]:  # who goes first alternates
                rates[name].append(epoch_rate(loader, epoch))
        med = {k: statistics.median(v[1:]) for k, v in rates.items()}
    print(
        f"{args.images} JPEGs {args.source_size[0]}x{args.source_size[1]} ({kb:.0f} KB each) -> "
        f"{args.image_size}x{args.image_size}, batch {args.batch_size}, {args.workers} worker(s), "
        f"{args.epochs} epochs a side (first left out), alternating\n"
    )
    print("| loader | samples/s per epoch | median |\n|---|---|---|")
    for name, v in rates.items():
        print(f"| {name} | {', '.join(f'{r:,.0f}' for r in v)} | **{med[name]:,.0f}** |")
    print(
        f"\nratio ddplab / hand-written: **{med['ddplab imagefolder'] / med['hand-written DataLoader']:.3f}**"
    )


if __name__ == "__main__":
    main()
