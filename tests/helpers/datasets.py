"""Shared by tests/unit/test_datasets.py and tests/integration/test_datasets.py."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np


def make_image_folder(root: Path, classes=("cat", "dog", "eel"), n_train=4, n_val=2) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                h, w = rng.integers(12, 30, 2)
                arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                Image.fromarray(arr).save(root / split / c / f"{i}.{'png' if i % 2 else 'jpg'}")


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    code = {np.uint8: 0x08, np.int32: 0x0C}[array.dtype.type]
    dims = array.shape
    header = bytes([0, 0, code, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)
    body = array.astype(">i4" if code == 0x0C else np.uint8).tobytes()
    data = header + body
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def make_idx_dataset(d: Path, n_train=24, n_test=10, gz=True, seed=0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    xs, ys = [], []
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, n).astype(np.uint8)
        write_idx(d / f"{prefix}-images-idx3-ubyte", x, gz)
        write_idx(d / f"{prefix}-labels-idx1-ubyte", y, gz)
        xs.append(x)
        ys.append(y)
    return xs[0], ys[0]


def make_cifar(d: Path, hundred: bool, per_batch=6, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    key, names = (
        (b"fine_labels", ["train", "test"])
        if hundred
        else (b"labels", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"])
    )
    first = None
    for name in names:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        first = data if first is None else first
        labels = rng.integers(0, 100 if hundred else 10, per_batch).tolist()
        batch = {b"data": data, key: labels, b"batch_label": name.encode()}
        if hundred:
            batch[b"coarse_labels"] = [label // 5 for label in labels]
        (d / name).write_bytes(pickle.dumps(batch))
    return first
