"""Datasets in runs: scikit-learn's digits read from its file without importing it (checked in a fresh
interpreter), ImageFolder's classes from its folders and a missing root in one line, and one training step on
each reader's tiny files (MNIST, Fashion-MNIST, CIFAR-10/100, ImageFolder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.datasets import make_cifar, make_idx_dataset, make_image_folder
from helpers.jobs import compose_cfg

import ddplab
from ddplab.config import ConfigError


@pytest.mark.slow  # starts a process
def test_digits_read_from_scikit_learns_file_equal_its_loader_without_importing_it():
    """The default dataset skips `import sklearn.datasets` (about 1 s per rank): the numbers are
    load_digits'."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from ddplab.data.datasets import _digits_arrays

    images, target = _digits_arrays()
    bunch = load_digits()
    assert images.shape == (1797, 8, 8) and (images == bunch.images).all() and (target == bunch.target).all()
    # ... and the data layer pulls in no Hydra (a DataLoader worker unpickling a dataset imports its module).
    probe = (
        "import sys, ddplab.data; from ddplab.data.datasets import digits; digits(); "
        "print('sklearn' in sys.modules, 'hydra' in sys.modules, 'omegaconf' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "False False False", out.stdout + out.stderr


@pytest.mark.slow  # starts a process
def test_imagefolder_infers_its_classes_from_the_folders_and_says_a_missing_root_in_one_line(tmp_path):
    """Like torchvision's ImageFolder: the class folders give dataset.num_classes (and so model.num_classes);
    a given one that disagrees is one line; a missing root names dataset.root and the path, exit 2."""
    from helpers.jobs import python_train

    make_image_folder(tmp_path / "data", classes=("a", "b", "c", "d"))
    args = [
        "dataset=imagefolder",
        "model=mlp",
        "dataset.image_size=8",
        "batch_size=4",
        "num_epochs=1",
        "progress=none",
    ]
    out = ddplab.run(compose_cfg(args + [f"dataset.root={tmp_path / 'data'}"], run_dir=tmp_path / "run"))
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)[
        "model"
    ]
    assert out["val/num_samples"] == 8 and last["net.7.weight"].shape[0] == 4  # 4 class folders: 4 outputs
    with pytest.raises(
        ConfigError,
        match=r"^dataset.num_classes=3, but .*train has 4 class folders. "
        r"Fix: dataset.num_classes=4$",
    ):
        ddplab.run(
            compose_cfg(
                args + [f"dataset.root={tmp_path / 'data'}", "dataset.num_classes=3"],
                run_dir=tmp_path / "run3",
            )
        )
    proc = python_train(
        args + [f"dataset.root={tmp_path / 'missing'}", f"hydra.run.dir={tmp_path / 'gone'}"], tmp_path
    )
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "config error: " in ln]
    assert proc.returncode == 2 and len(said) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"config error: dataset.root='{tmp_path / 'missing'}': no such file or directory" in said[0], said[
        0
    ]


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
