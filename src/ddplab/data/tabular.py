"""Tabular and text datasets that ship with their packages or are made here: no downloads."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ddplab.data.datasets import Splits, TensorData


def _split(n: int, val_fraction: float, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(
            f"dataset.val_fraction={val_fraction}: must be in (0, 1). Fix: dataset.val_fraction=0.2"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed))
    k = max(1, round(n * val_fraction))
    return perm[k:], perm[:k]


def diabetes(
    val_fraction: float = 0.2,
    split_seed: int = 0,
    num_classes: int = 1,
    in_channels: int = 10,
    image_size: int = 1,
) -> Splits:
    """scikit-learn's diabetes regression data (442 patients, 10 features, ships with it).

    Features and target are standardised with the training split's statistics, so an
    MSE of 1.0 is what predicting the mean scores. ``in_channels``/``image_size`` describe
    the 10 features as a 1x1 image of 10 channels, the shape the MLP model config reads.
    """
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes()
    x = torch.as_tensor(bunch.data, dtype=torch.float32)
    y = torch.as_tensor(bunch.target, dtype=torch.float32)
    if in_channels * image_size**2 != x.shape[1]:
        raise ValueError(
            f"dataset.in_channels={in_channels} x image_size={image_size}**2 must be the "
            f"{x.shape[1]} features of diabetes. Fix: drop the override"
        )
    train, val = _split(len(y), val_fraction, split_seed)
    x = (x - x[train].mean(0)) / x[train].std(0)
    y = (y - y[train].mean()) / y[train].std()
    return Splits(TensorData(x[train], y[train]), TensorData(x[val], y[val]), num_classes)


def text(
    path: str | None = None,
    block_size: int = 64,
    val_fraction: float = 0.1,
    vocab_size: int = 256,
    split_seed: int = 0,
) -> Splits:
    """A text file as bytes, cut into windows of ``block_size + 1`` (inputs, next bytes).

    ``path=null`` uses a generated English-like corpus (deterministic, about 60 KB), so the
    preset runs anywhere. Validation windows are a fixed random subset.
    """
    if vocab_size != 256:
        raise ValueError(
            f"dataset.vocab_size={vocab_size}: text is read as bytes (256 symbols). Fix: drop it"
        )
    if path is None:
        data = generated_corpus().encode()
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(
                f"dataset.path={path}: no such file. Fix: point it at a text file (or null for "
                "the generated corpus)"
            )
        data = p.read_bytes()
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n = (len(tokens) - 1) // block_size
    if n < 2:
        raise ValueError(
            f"dataset.path={path}: {len(tokens)} bytes make fewer than 2 windows of "
            f"dataset.block_size={block_size}. Fix: a longer text or a smaller block_size"
        )
    starts = torch.arange(n) * block_size
    windows = torch.stack([tokens[s : s + block_size + 1] for s in starts.tolist()])
    train, val = _split(n, val_fraction, split_seed)
    return Splits(
        TensorData(windows[train, :-1], windows[train, 1:]),
        TensorData(windows[val, :-1], windows[val, 1:]),
        vocab_size,
    )


def generated_corpus(sentences: int = 1500, seed: int = 0) -> str:
    """Sentences from a small grammar: structure a byte-level model can learn in a minute on a CPU."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird", "the farmer"]
    verbs = ["sees", "likes", "finds", "follows", "paints", "feeds", "calls"]
    objects = ["the river", "a red apple", "the green hill", "an open door", "the quiet town", "a tall tree"]
    tails = ["today", "every morning", "in the rain", "after dinner", "near the sea", "without a word"]
    out = []
    for _ in range(sentences):
        s = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}."
        out.append(s[0].upper() + s[1:])
    return " ".join(out) + "\n"
