"""Readers of the real dataset formats, on tiny files written here in each format."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.datasets import make_image_folder
from helpers.jobs import compose_cfg

import ddplab
from ddplab.config import ConfigError, validate
from ddplab.data import DatasetFilesError, cifar10, cifar100, imagefolder, mnist, read_idx


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


def test_idx_reader_gzipped_and_plain(tmp_path):
    x, y = make_idx_dataset(tmp_path / "gz", gz=True)
    assert np.array_equal(read_idx(tmp_path / "gz" / "train-images-idx3-ubyte.gz"), x)
    make_idx_dataset(tmp_path / "plain" / "MNIST" / "raw", gz=False)  # torchvision's download layout
    s = mnist(str(tmp_path / "plain"))
    assert s.train.x.shape == (24, 1, 28, 28) and s.val.x.shape == (10, 1, 28, 28) and s.num_classes == 10
    s = mnist(str(tmp_path / "gz"))
    assert torch.equal(s.train.y, torch.from_numpy(y.astype(np.int64)))
    expected = (x[3, 5, 7] / 255.0 - 0.1307) / 0.3081  # standard MNIST normalisation
    assert s.train.x[3, 0, 5, 7].item() == pytest.approx(expected, rel=1e-5)
    # A truncated file says so.
    raw = tmp_path / "plain" / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    raw.write_bytes(raw.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        mnist(str(tmp_path / "plain"))


def test_cifar10_and_cifar100_python_batches(tmp_path):
    first = make_cifar(tmp_path / "c10" / "cifar-10-batches-py", hundred=False)
    s = cifar10(str(tmp_path / "c10"))
    assert s.train.x.shape == (30, 3, 32, 32) and s.val.x.shape == (6, 3, 32, 32) and s.num_classes == 10
    # Row-major 3x1024 planes: red plane first.
    assert s.train.x[0, 0, 0, 1].item() == pytest.approx((first[0, 1] / 255.0 - 0.4914) / 0.2470, rel=1e-5)
    assert s.train.x[0, 2, 0, 0].item() == pytest.approx((first[0, 2048] / 255.0 - 0.4465) / 0.2616, rel=1e-5)
    make_cifar(tmp_path / "c100", hundred=True)
    s = cifar100(str(tmp_path / "c100"))
    assert s.train.x.shape == (6, 3, 32, 32) and s.num_classes == 100 and int(s.train.y.max()) < 100


def test_missing_root_or_files_say_what_is_expected(tmp_path):
    with pytest.raises(
        ConfigError, match=r"dataset.root=None: .*mnist reads local files.*Fix: dataset.root="
    ):
        validate(compose_cfg(["dataset=mnist"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetFilesError) as e:
        mnist(str(tmp_path / "empty"))
    msg = str(e.value)
    assert "train-images-idx3-ubyte" in msg and "t10k-labels-idx1-ubyte" in msg and "MNIST/raw" in msg
    assert "yann.lecun.com" in msg
    with pytest.raises(DatasetFilesError, match=r"data_batch_1.*test_batch.*cifar-10-batches-py.*toronto"):
        cifar10(str(tmp_path / "empty"))
    with pytest.raises(DatasetFilesError, match="no such directory"):
        cifar100(str(tmp_path / "nope"))


def test_imagefolder_decodes_resizes_and_checks_classes(tmp_path):
    make_image_folder(tmp_path / "imgs")
    s = imagefolder(str(tmp_path / "imgs"), num_classes=3, image_size=16)
    assert len(s.train) == 12 and len(s.val) == 6 and s.num_classes == 3
    x, y = s.train[5]
    # sorted classes: cat, dog, eel
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and int(y) == 1
    with pytest.raises(ValueError, match="dataset.num_classes=5, but .* has 3 class folders"):
        imagefolder(str(tmp_path / "imgs"), num_classes=5)
    with pytest.raises(DatasetFilesError, match="dataset.val_dir"):
        imagefolder(str(tmp_path / "imgs"), num_classes=3, val_dir="validation")


@pytest.mark.parametrize(
    "dataset,maker",
    [
        ("mnist", lambda d: make_idx_dataset(d, gz=True)),
        ("fashion_mnist", lambda d: make_idx_dataset(d / "FashionMNIST" / "raw", gz=False)),
        ("cifar10", lambda d: make_cifar(d, hundred=False)),
        ("cifar100", lambda d: make_cifar(d / "cifar-100-python", hundred=True)),
        ("imagefolder", lambda d: make_image_folder(d)),
    ],
)
def test_each_dataset_trains_a_step(tmp_path, dataset, maker):
    maker(tmp_path / "data")
    args = [
        f"dataset={dataset}",
        f"dataset.root={tmp_path / 'data'}",
        "model=convnet",
        "batch_size=4",
        "num_epochs=1",
        "progress=none",
    ]
    if dataset == "imagefolder":
        args += ["dataset.num_classes=3", "dataset.image_size=16"]
    out = ddplab.run(compose_cfg(args, run_dir=tmp_path / "run"))
    assert out["step"] >= 1 and np.isfinite(out["val/loss"])
    n_val = {"mnist": 10, "fashion_mnist": 10, "cifar10": 6, "cifar100": 6, "imagefolder": 6}[dataset]
    assert out["val/num_samples"] == n_val


def test_a_crafted_cifar_batch_cannot_run_code(tmp_path):
    """CIFAR batches are pickles: only arrays, lists, bytes and numbers may come out of them."""
    import os

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    d = tmp_path / "c10" / "cifar-10-batches-py"
    make_cifar(d, hundred=False)
    batch = pickle.loads((d / "data_batch_1").read_bytes())
    batch[b"batch_label"] = Payload()
    (d / "data_batch_1").write_bytes(pickle.dumps(batch))
    with pytest.raises(pickle.UnpicklingError, match=r"data_batch_1: refused to load (posix|os)\.system"):
        cifar10(str(tmp_path / "c10"))
    assert not marker.exists()
    # the payload is real
    assert pickle.loads((d / "data_batch_1").read_bytes()) is not None and marker.exists()
