"""Augmentation of whole batches on the training device.

One random crop offset and flip bit per sample, applied to the (B, C, H, W)
batch with a handful of tensor ops, instead of a Python transform per sample in
a DataLoader worker: the approach of the CIFAR-10 speed-run trainers. Random
numbers come from the device's global generator, which the trainer seeds per
(seed, epoch, rank) and checkpoints, so a resumed run draws the same crops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset


class BatchAugment:
    def __init__(self, crop_padding: int = 0, hflip: bool = False):
        if crop_padding < 0:
            raise ValueError(f"dataset.augment.crop_padding={crop_padding}: must be >= 0")
        self.pad, self.hflip = int(crop_padding), bool(hflip)

    @property
    def enabled(self) -> bool:
        return self.pad > 0 or self.hflip

    def __call__(self, x: Tensor) -> Tensor:
        if self.pad:
            x = self._random_crop(x)
        if self.hflip:
            flip = torch.rand(x.shape[0], device=x.device) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
        return x

    def _random_crop(self, x: Tensor) -> Tensor:
        """Zero-pad by ``pad`` and cut an H x W window at a random offset per sample."""
        b, _, h, w = x.shape
        p, dev = self.pad, x.device
        padded = F.pad(x, (p, p, p, p))
        dy = torch.randint(0, 2 * p + 1, (b, 1), device=dev)
        dx = torch.randint(0, 2 * p + 1, (b, 1), device=dev)
        rows = (dy + torch.arange(h, device=dev))[:, :, None]  # (B, H, 1)
        cols = (dx + torch.arange(w, device=dev))[:, None, :]  # (B, 1, W)
        batch = torch.arange(b, device=dev)[:, None, None]
        # Advanced indices around the channel slice put their (B, H, W) first: NHWC.
        return padded[batch, :, rows, cols].permute(0, 3, 1, 2)

    def __repr__(self) -> str:
        return f"BatchAugment(crop_padding={self.pad}, hflip={self.hflip})"


class PerSampleAugment(Dataset):
    """The same augmentation one sample at a time, for the DataLoader path."""

    def __init__(self, data: Dataset, augment: BatchAugment):
        self.data, self.augment = data, augment

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x, y = self.data[i]
        return self.augment(x[None])[0].contiguous(), y
