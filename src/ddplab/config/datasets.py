"""Schemas of the dataset group (conf/dataset): one dataclass an option's yaml picks, its defaults here, once
(ddplab.config.groups lists them by option)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ddplab.config.choices import Stats
from ddplab.config.errors import require


@dataclass
class AugmentConfig:
    """Training-time augmentation, applied to whole batches on the training device."""

    crop_padding: int = 0  # >0: zero-pad by this many pixels, then crop back at a random offset
    hflip: bool = False  # random horizontal flip (wrong for digits/text: leave off there)

    @staticmethod
    def check(c: Any, key: str) -> None:
        require(
            c.crop_padding >= 0,
            f"{key}.crop_padding",
            c.crop_padding,
            "must be >= 0",
            f"pass {key}.crop_padding=4 (or 0: off)",
        )


@dataclass
class DigitsConfig:
    """scikit-learn's 1,797 8x8 handwritten digits, split once with a fixed seed."""

    _target_: str = "ddplab.data.digits"
    val_fraction: float = 0.2  # held out for validation, once, by split_seed
    split_seed: int = 0  # fixed, independent of `seed`: the val set never moves
    num_classes: int = 10  # read by the model configs through interpolation; fixed by the data
    in_channels: int = 1  # image channels (grey: 1); the models read it through interpolation
    image_size: int = 8  # image width and height in pixels; the models read it through interpolation
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass
class SyntheticConfig:
    """Random class-conditional images: learnable, any shape, any size."""

    _target_: str = "ddplab.data.synthetic"
    num_train: int = 1024  # training images
    num_val: int = 256  # validation images
    num_classes: int = 10  # classes (one prototype image each)
    in_channels: int = 3  # image channels
    image_size: int = 32  # width and height
    noise: float = 1.0  # std of the noise around each class's prototype image
    seed: int = 0  # the images' own seed (not the run's)
    augment: AugmentConfig = field(default_factory=AugmentConfig)

    @staticmethod
    def check(c: Any, key: str) -> None:
        for k in ("num_train", "num_val", "num_classes", "image_size"):
            # num_val=0 would train with no validation at all: no val metrics, no best.pt.
            require(c[k] >= 1, f"{key}.{k}", c[k], "must be >= 1", f"pass {key}.{k}=32")


@dataclass
class FilesConfig:
    """Datasets read from local files under `root` (nothing is downloaded)."""

    _target_: str = MISSING
    root: Optional[str] = None  # the folder holding the files; required
    num_classes: int = 10  # the dataset's classes
    in_channels: int = 1  # image channels
    image_size: int = 28  # width and height
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass
class MNISTConfig(FilesConfig):
    """MNIST's (or Fashion-MNIST's) four IDX files, gzipped or not."""

    _target_: str = "ddplab.data.mnist"


@dataclass
class CIFARConfig(FilesConfig):
    """CIFAR-10/100 python batches."""

    _target_: str = "ddplab.data.cifar10"
    in_channels: int = 3  # RGB
    image_size: int = 32  # width and height
    augment: AugmentConfig = field(default_factory=lambda: AugmentConfig(crop_padding=4, hflip=True))


@dataclass
class ImageFolderConfig(FilesConfig):
    """root/train/<class>/<image> and root/val/<class>/<image>, decoded with Pillow."""

    _target_: str = "ddplab.data.imagefolder"
    num_classes: Optional[int] = None  # null: the number of class folders; a value is checked against them
    in_channels: int = 3  # decoded as RGB
    image_size: int = 224  # short side resized to this, centre crop to square
    train_dir: str = "train"  # under root: one folder per class
    val_dir: str = "val"  # under root: the same class folders
    stats: Stats = Stats.imagenet  # per-channel normalisation of this dataset
    augment: AugmentConfig = field(default_factory=lambda: AugmentConfig(crop_padding=0, hflip=True))


@dataclass
class DiabetesConfig:
    """scikit-learn's diabetes regression data: 442 patients, 10 standardised features (task=regression)."""

    _target_: str = "ddplab.data.diabetes"
    val_fraction: float = 0.2  # held out for validation, once, by split_seed
    split_seed: int = 0  # fixed, independent of `seed`: the val set never moves
    num_classes: int = 1  # one output: the disease progression
    in_channels: int = 10  # the 10 features, as channels of a 1x1 "image" (the models read it so)
    image_size: int = 1  # a 1x1 "image": the features are its channels


@dataclass
class TextConfig:
    """A local text file as bytes, in windows of block_size (task=lm); null path: a generated corpus."""

    _target_: str = "ddplab.data.text"
    path: Optional[str] = None  # a local text file; null: a generated corpus
    block_size: int = 64  # tokens (bytes) per sample
    val_fraction: float = 0.1  # the file's last part, held out for validation
    vocab_size: int = 256  # bytes
    split_seed: int = 0  # fixed, independent of `seed`

    @staticmethod
    def check(c: Any, key: str) -> None:
        require(
            c.path is None or os.path.isfile(os.path.expanduser(c.path)),
            f"{key}.path",
            c.path,
            "no such file (nothing is downloaded)",
            f"point {key}.path at a text file, or {key}.path=null for the generated corpus",
        )
        require(
            c.block_size >= 2, f"{key}.block_size", c.block_size, "must be >= 2", f"pass {key}.block_size=64"
        )


def _check_token_values(c: Any, key: str) -> None:
    """What every token-file dataset checks: the dtype, the window, the vocabulary fitting the dtype."""
    require(
        c.dtype in ("uint16", "uint32"),
        f"{key}.dtype",
        c.dtype,
        "must be uint16 or uint32",
        f"pass {key}.dtype=uint16",
    )
    require(c.block_size >= 2, f"{key}.block_size", c.block_size, "must be >= 2", f"pass {key}.block_size=64")
    top = 2**16 if c.dtype == "uint16" else 2**32
    require(
        2 <= c.vocab_size <= top,
        f"{key}.vocab_size",
        c.vocab_size,
        f"must be in [2, {top}] for {c.dtype}",
        f"pass {key}.dtype=uint32" if c.vocab_size > top else f"pass {key}.vocab_size=256",
    )


@dataclass
class TokensConfig:
    """A flat binary of token ids (nanoGPT's train.bin layout) read a window at a time (task=lm)."""

    _target_: str = "ddplab.data.tokens"
    path: Optional[str] = None  # required: scripts/make_tokens.py writes one
    val_path: Optional[str] = None  # null: the last val_fraction of path's windows
    dtype: str = "uint16"  # uint16 | uint32, as the file was written
    block_size: int = 64  # tokens per sample: window i is tokens [i*B, i*B + B]
    vocab_size: int = 256  # bytes; your tokenizer's vocabulary otherwise
    val_fraction: float = 0.1  # with val_path null: the last part of path's windows, never trained on

    @staticmethod
    def check(c: Any, key: str) -> None:
        require(
            c.path is not None,
            f"{key}.path",
            c.path,
            "is not set",
            f"pass {key}.path=train.bin (scripts/make_tokens.py writes one)",
        )
        for name in ("path", "val_path"):
            v = c[name]
            require(
                v is None or os.path.isfile(os.path.expanduser(v)),
                f"{key}.{name}",
                v,
                "no such file",
                f"point {key}.{name} at a token file",
            )
        _check_token_values(c, key)
        require(
            0.0 < c.val_fraction < 1.0,
            f"{key}.val_fraction",
            c.val_fraction,
            "must be in (0, 1)",
            f"pass {key}.val_fraction=0.1",
        )


@dataclass
class TokenShardsConfig:
    """A folder of token files streamed shard by shard (task=lm); validation from val_path."""

    _target_: str = "ddplab.data.token_shards"
    path: Optional[str] = None  # a folder of *.bin token files: scripts/make_tokens.py --shards N writes one
    val_path: Optional[str] = None  # a token file, or a folder of them
    dtype: str = "uint16"  # uint16 | uint32, as the files were written
    block_size: int = 64  # tokens per sample
    vocab_size: int = 256  # bytes; your tokenizer's vocabulary otherwise
    seed: int = 0  # conf/dataset/token_shards.yaml: ${seed}

    @staticmethod
    def check(c: Any, key: str) -> None:
        for name, what in (
            ("path", "a folder of token files"),
            ("val_path", "a token file or a folder of them"),
        ):
            v = c[name]
            require(
                v is not None and os.path.exists(os.path.expanduser(v)),
                f"{key}.{name}",
                v,
                "no such file or folder",
                f"point {key}.{name} at {what} (scripts/make_tokens.py --shards N writes both)",
            )
        _check_token_values(c, key)


@dataclass
class HFDataConfig:
    """Local Parquet / JSON Lines / CSV / Arrow files through Hugging Face datasets (the hf extra)."""

    _target_: str = "ddplab.data.hf.hf"
    path: Optional[str] = None  # a data file, or a folder of files of one format; required
    val_path: Optional[str] = None  # the same for validation; null: the last val_fraction of the samples
    x: str = "text"  # the input column: text (tokenized with tokenizer), token ids, or numbers
    y: Optional[str] = None  # the label/value column; null: language-model windows of x (task=lm)
    tokenizer: Optional[str] = None  # a local tokenizer.json, for a text column
    block_size: int = 64  # tokens per window (task=lm), or per row (cut or padded)
    vocab_size: int = 256  # the tokenizer's vocabulary (model.vocab_size follows it)
    num_classes: Optional[int] = None  # with y: the classes
    pad_id: int = 0  # with y and text: the id rows shorter than block_size are padded with
    val_fraction: float = 0.1  # without val_path
    cache_dir: Optional[str] = None  # datasets' cache of the converted files; null: its default
    streaming: bool = False  # read row by row in constant memory, as one stream (needs val_path)
    # with streaming: the samples an epoch yields; null: counted at start-up
    num_samples: Optional[int] = None

    @staticmethod
    def check(c: Any, key: str) -> None:
        require(
            c.path is not None and os.path.exists(os.path.expanduser(c.path)),
            f"{key}.path",
            c.path,
            "no such file or folder",
            f"point {key}.path at a Parquet/JSONL/CSV/Arrow file or a folder of them",
        )
        require(
            c.block_size >= 1, f"{key}.block_size", c.block_size, "must be >= 1", f"pass {key}.block_size=64"
        )
        require(
            not c.streaming or c.val_path is not None,
            f"{key}.val_path",
            c.val_path,
            "a stream has no last fraction to hold out",
            f"pass {key}.val_path=<validation files>",
        )
        require(
            c.num_samples is None or c.num_samples >= 1,
            f"{key}.num_samples",
            c.num_samples,
            "must be >= 1",
            f"drop {key}.num_samples (counted at start-up)",
        )
