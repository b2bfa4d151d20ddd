"""Readers of the real dataset formats (IDX, CIFAR-10/100 batches, ImageFolder), on tiny files written here in
each format: what they read, a missing root or file said with what is expected, and a crafted CIFAR pickle
that cannot run code."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from helpers.datasets import make_cifar, make_idx_dataset, make_image_folder
from helpers.jobs import compose_cfg

from ddplab.config import ConfigError, validate
from ddplab.data import DatasetFilesError, cifar10, cifar100, imagefolder, mnist, read_idx


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
