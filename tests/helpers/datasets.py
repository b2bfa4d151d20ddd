"""Shared by tests/unit/test_datasets.py and tests/integration/test_datasets.py."""

from __future__ import annotations

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
