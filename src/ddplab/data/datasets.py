"""Datasets that fit in memory, returned as (train, val) tensor pairs.

No Hydra here: the factory arguments are the keys of conf/dataset/*.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor


@dataclass
class TensorData:
    """Inputs ``x`` (N, ...) and targets ``y`` (N, ...): images and labels, features and values,
    token windows and next tokens.

    Also a map-style torch Dataset, so a DataLoader can read it; the trainer
    instead indexes whole batches at once (no per-sample collate).
    """

    x: Tensor
    y: Tensor

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} images but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


@dataclass
class Splits:
    """What a dataset factory returns (a ``(train, val)`` pair or a dict with those keys work too)."""

    train: TensorData | torch.utils.data.Dataset
    val: TensorData | torch.utils.data.Dataset
    num_classes: int | None = None
    # Turns a list of samples into a batch (DataLoader's collate_fn); None: torch's default.
    collate_fn: Callable[[list[Any]], Any] | None = None


def _expect(name: str, given: int, actual: int) -> None:
    if given != actual:
        raise ValueError(f"dataset.{name}={given}, but this dataset has {actual}. Fix: drop the override.")


def _digits_arrays() -> tuple[Any, Any]:
    """The digits' images (1797, 8, 8) and labels, read from the file scikit-learn ships, without importing
    scikit-learn: ``import sklearn.datasets`` costs about 1 s per rank, reading the file 0.03 s (the same
    numbers as ``load_digits()``; tests/integration/test_datasets.py checks)."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():  # another layout in a future scikit-learn: its own loader
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(np.int64)


def digits(
    val_fraction: float = 0.2,
    split_seed: int = 0,
    num_classes: int = 10,
    in_channels: int = 1,
    image_size: int = 8,
) -> Splits:
    """scikit-learn's 1,797 real 8x8 digits (ships with the package: no download)."""
    _expect("num_classes", num_classes, 10)
    _expect("in_channels", in_channels, 1)
    _expect("image_size", image_size, 8)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(
            f"dataset.val_fraction={val_fraction}: must be in (0, 1). Fix: dataset.val_fraction=0.2"
        )
    images, target = _digits_arrays()
    x = torch.as_tensor(images, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8), 0..16
    y = torch.as_tensor(target, dtype=torch.int64)
    # A fixed permutation, independent of the training seed: the val set is the
    # same in every run, so val metrics compare across runs and sweeps.
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    num_val = round(len(y) * val_fraction)
    val_idx, train_idx = perm[:num_val], perm[num_val:]
    mean, std = x[train_idx].mean(), x[train_idx].std()  # train statistics only
    x = (x - mean) / std
    return Splits(TensorData(x[train_idx], y[train_idx]), TensorData(x[val_idx], y[val_idx]), 10)


def synthetic(
    num_train: int = 1024,
    num_val: int = 256,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    noise: float = 1.0,
    seed: int = 0,
) -> Splits:
    """Each class has a random prototype image; samples are prototype + noise.

    Learnable (unlike uniform random labels), so tests can assert that loss
    falls, and any shape/size can be had for benchmarks.
    """
    for name, v in (
        ("num_train", num_train),
        ("num_classes", num_classes),
        ("in_channels", in_channels),
        ("image_size", image_size),
    ):
        if v <= 0:
            raise ValueError(f"dataset.{name}={v}: must be > 0")
    if num_val < 0:
        raise ValueError(f"dataset.num_val={num_val}: must be >= 0")
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(num_classes, in_channels, image_size, image_size, generator=g)

    def make(n: int) -> TensorData:
        y = torch.randint(num_classes, (n,), generator=g)
        x = protos[y] + noise * torch.randn(n, in_channels, image_size, image_size, generator=g)
        return TensorData(x, y)

    return Splits(make(num_train), make(num_val), num_classes)
