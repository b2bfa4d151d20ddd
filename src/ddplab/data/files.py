"""Real datasets read from local files (nothing is downloaded): MNIST, Fashion-MNIST, CIFAR, image folders.

``dataset.root`` points at the files. Each reader accepts the folder that holds
the files itself, or the layout torchvision downloads into (``root/MNIST/raw``,
``root/cifar-10-batches-py`` ...), so an existing torchvision download works
as is. A missing file is an error that lists what is expected and where to get it.

Normalisation uses each dataset's standard per-channel mean/std (the values
published with the torchvision/timm recipes), so numbers compare with the
literature; augmentation is configured per dataset (``conf/dataset/*.yaml``)
and runs batched on the training device.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ddplab.data.datasets import Splits, TensorData
from ddplab.errors import InputError

MNIST_URL = (
    "https://yann.lecun.com/exdb/mnist/ (or any mirror; torchvision's MNIST(download=True) layout works)"
)
FASHION_URL = "https://github.com/zalandoresearch/fashion-mnist#get-the-data"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html (the 'python version' archive, unpacked)"

_STATS = {  # (mean, std) per channel of the training images scaled to [0, 1]
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


class DatasetFilesError(FileNotFoundError):
    pass


def _root(root: str | None, name: str, url: str) -> Path:
    if not root:
        raise DatasetFilesError(
            f"dataset.root is not set: {name} is read from local files (nothing is "
            f"downloaded). Fix: dataset.root=/path/to/{name}; get the files from {url}"
        )
    path = Path(root).expanduser()
    if not path.exists():
        raise DatasetFilesError(
            f"dataset.root={root}: no such directory. Fix: point it at the folder holding "
            f"the {name} files; get them from {url}"
        )
    return path


def _find(root: Path, names: list[str], subdirs: list[str], what: str, url: str) -> list[Path]:
    """The files ``names`` in root or one of its known sub-folders (each name also as ``name.gz``)."""
    for sub in ["", *subdirs]:
        d = root / sub
        found = [next((p for p in (d / n, d / f"{n}.gz") if p.is_file()), None) for n in names]
        if all(found):
            return found  # type: ignore[return-value]
    tried = ", ".join(str(root / s) if s else str(root) for s in ["", *subdirs])
    raise DatasetFilesError(
        f"dataset.root={root}: {what} files not found. Expected {', '.join(names)} "
        f"(each may be gzipped) in one of: {tried}. Get them from {url}"
    )


def _normalise(x: Tensor, name: str) -> Tensor:
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in _STATS[name])
    return (x - mean) / std


# ---------------------------------------------------------------------- IDX
def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format): magic 0x0000 | type | ndim, big-endian dims, then the data."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    dtype = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}.get(raw[2])
    if dtype is None:
        raise ValueError(f"{path}: unknown IDX element type 0x{raw[2]:02x}")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=dtype, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} but the file holds {data.size} values (truncated?)")
    return data.reshape(shape)


def _idx_dataset(name: str, root: str | None, subdir: str, url: str) -> Splits:
    path = _root(root, name, url)
    files = [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ]
    found = _find(path, files, [f"{subdir}/raw", subdir, "raw"], name, url)
    xtr, ytr, xte, yte = (read_idx(p) for p in found)

    def split(x: np.ndarray, y: np.ndarray) -> TensorData:
        images = torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)  # (N, 1, 28, 28)
        return TensorData(_normalise(images, name), torch.from_numpy(y.astype(np.int64)))

    return Splits(split(xtr, ytr), split(xte, yte), 10)


def mnist(
    root: str | None = None, num_classes: int = 10, in_channels: int = 1, image_size: int = 28
) -> Splits:
    """MNIST from its four IDX files (train 60,000 / test 10,000), gzipped or not."""
    return _idx_dataset("mnist", root, "MNIST", MNIST_URL)


def fashion_mnist(
    root: str | None = None, num_classes: int = 10, in_channels: int = 1, image_size: int = 28
) -> Splits:
    """Fashion-MNIST: the same IDX files and names as MNIST."""
    return _idx_dataset("fashion_mnist", root, "FashionMNIST", FASHION_URL)


# -------------------------------------------------------------------- CIFAR
class _ArraysOnly(pickle.Unpickler):
    """Unpickles what CIFAR's python batches hold — dicts, lists, bytes, numbers and numpy
    arrays — and refuses every other global, so a crafted batch file cannot run code."""

    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
    }

    def __init__(self, f, path: Path):
        super().__init__(f, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{self.path}: refused to load {module}.{name} — a CIFAR batch holds only arrays, lists, bytes "
            "and "
            "numbers, so this file is not one (or was crafted to run code). Fix: the original CIFAR files"
        )


def _unpickle(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return _ArraysOnly(f, path).load()


def _cifar_split(batches: list[Path], label_key: bytes, name: str) -> TensorData:
    xs, ys = [], []
    for p in batches:
        d = _unpickle(p)
        if b"data" not in d or label_key not in d:
            raise ValueError(f"{p}: not a CIFAR python batch (expected keys b'data' and {label_key!r})")
        xs.append(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(d[label_key], dtype=np.int64))
    x = torch.from_numpy(np.concatenate(xs).astype(np.float32) / 255.0)
    return TensorData(_normalise(x, name), torch.from_numpy(np.concatenate(ys)))


def cifar10(
    root: str | None = None, num_classes: int = 10, in_channels: int = 3, image_size: int = 32
) -> Splits:
    """CIFAR-10 from the python batches (data_batch_1..5 train 50,000, test_batch 10,000)."""
    path = _root(root, "cifar10", CIFAR_URL)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    found = _find(path, names, ["cifar-10-batches-py"], "cifar10", CIFAR_URL)
    return Splits(
        _cifar_split(found[:5], b"labels", "cifar10"), _cifar_split(found[5:], b"labels", "cifar10"), 10
    )


def cifar100(
    root: str | None = None, num_classes: int = 100, in_channels: int = 3, image_size: int = 32
) -> Splits:
    """CIFAR-100 from the python files ``train`` and ``test`` (fine labels, 100 classes)."""
    path = _root(root, "cifar100", CIFAR_URL)
    train, test = _find(path, ["train", "test"], ["cifar-100-python"], "cifar100", CIFAR_URL)
    return Splits(
        _cifar_split([train], b"fine_labels", "cifar100"),
        _cifar_split([test], b"fine_labels", "cifar100"),
        100,
    )


# -------------------------------------------------------------- imagefolder
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


class ImageFolder(Dataset):
    """``split_dir/<class>/<image>``, decoded with Pillow per sample (DataLoader workers do it in parallel).

    Images are converted to RGB (or L), resized so the short side is
    ``image_size`` and centre-cropped to square, then normalised.
    """

    def __init__(self, split_dir: Path, classes: list[str], image_size: int, in_channels: int, stats: str):
        self.classes, self.image_size, self.mode = classes, image_size, "L" if in_channels == 1 else "RGB"
        self.samples = [
            (p, i)
            for i, c in enumerate(classes)
            for p in sorted((split_dir / c).iterdir())
            if p.suffix.lower() in IMAGE_SUFFIXES
        ]
        mean, std = _STATS[stats]
        if in_channels == 1:
            mean, std = (sum(mean) / 3,), (sum(std) / 3,)
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        from PIL import Image

        path, label = self.samples[i]
        try:
            im = _decode(path, self.mode)
        except Image.DecompressionBombError as e:  # Pillow's message names the size, not the file
            raise ImageFileError(
                f"{path}: {e} Fix: shrink or remove this image, or raise PIL.Image.MAX_IMAGE_PIXELS "
                "in your own code if you trust the file"
            ) from None
        except (OSError, SyntaxError, ValueError) as e:  # truncated, not an image, a broken header
            raise ImageFileError(
                f"{path}: cannot be decoded ({type(e).__name__}: {e}). Fix: replace or remove this file"
            ) from None
        with im:
            w, h = im.size
            s = self.image_size / min(w, h)
            im = im.resize(
                (max(self.image_size, round(w * s)), max(self.image_size, round(h * s))), Image.BILINEAR
            )
            w, h = im.size
            left, top = (w - self.image_size) // 2, (h - self.image_size) // 2
            im = im.crop((left, top, left + self.image_size, top + self.image_size))
            arr = np.asarray(im, dtype=np.float32) / 255.0
        x = torch.from_numpy(arr).reshape(self.image_size, self.image_size, -1).permute(2, 0, 1)
        return (x - self.mean) / self.std, torch.tensor(label)


class ImageFileError(InputError):
    """An image that cannot be decoded: the message starts with its path."""


def _decode(path: Path, mode: str) -> Any:
    from PIL import Image

    with Image.open(path) as im:
        return im.convert(mode)


def imagefolder(
    root: str | None = None,
    num_classes: int | None = None,
    in_channels: int = 3,
    image_size: int = 224,
    train_dir: str = "train",
    val_dir: str = "val",
    stats: str = "imagenet",
) -> Splits:
    """Class sub-folders of images under ``root/train`` and ``root/val`` (ImageNet layout)."""
    url = "your own images: root/train/<class>/*.jpg and root/val/<class>/*.jpg"
    path = _root(root, "imagefolder", url)
    tdir, vdir = path / train_dir, path / val_dir
    for d, key in ((tdir, "train_dir"), (vdir, "val_dir")):
        if not d.is_dir():
            raise DatasetFilesError(
                f"dataset.{key}: {d} is not a directory. Expected {path}/{train_dir}/<class>/"
                f"<image> and {path}/{val_dir}/<class>/<image>. Fix: dataset.{key}=<sub-folder>"
            )
    classes = sorted(p.name for p in tdir.iterdir() if p.is_dir())
    if not classes:
        raise DatasetFilesError(f"{tdir}: no class sub-folders. Expected {tdir}/<class>/<image>")
    missing = sorted(set(p.name for p in vdir.iterdir() if p.is_dir()) - set(classes))
    if missing:
        raise DatasetFilesError(f"{vdir}: classes {missing} have no training folder in {tdir}")
    if num_classes is not None and num_classes != len(classes):
        raise ValueError(
            f"dataset.num_classes={num_classes}, but {tdir} has {len(classes)} class folders. "
            f"Fix: dataset.num_classes={len(classes)}"
        )
    if stats not in _STATS:
        raise ValueError(f"dataset.stats={stats}: unknown. Fix: one of {sorted(_STATS)}")
    train = ImageFolder(tdir, classes, image_size, in_channels, stats)
    val = ImageFolder(vdir, classes, image_size, in_channels, stats)
    for split, d in ((train, tdir), (val, vdir)):
        if len(split) == 0:
            raise DatasetFilesError(
                f"{d}: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in its class folders"
            )
    return Splits(train, val, len(classes))
