"""task=vae: a variational autoencoder's two losses, logged separately (the seed tutorial's
MMVAE pattern, one modality), and a TensorBoard grid of reconstructions at each evaluation."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ddplab.task import Task, TaskOutput


class VAETask(Task):
    """(images, labels) → loss = reconstruction + beta * KL per sample, both logged (``recon``, ``kl``).

    The model returns ``(reconstruction, mu, logvar)`` (see :class:`ddplab.models.VAE`);
    labels are ignored. Reconstruction error is the squared error summed over pixels.
    """

    metric_names = ("recon", "kl")

    def __init__(self, beta: float = 1.0, num_images: int = 8):
        self.beta, self.num_images = beta, num_images

    def __call__(self, model: nn.Module, batch: tuple[Tensor, Any]) -> TaskOutput:
        x = batch[0]
        recon, mu, logvar = model(x)
        rec = (recon.float() - x.float()).pow(2).flatten(1).sum(1)  # per sample
        kl = -0.5 * (1 + logvar.float() - mu.float().pow(2) - logvar.float().exp()).sum(1)
        n = x.shape[0]
        return TaskOutput((rec + self.beta * kl).mean(), n, {"recon": (rec.sum(), n), "kl": (kl.sum(), n)})

    @torch.no_grad()
    def visualize(self, model: nn.Module, batch: tuple[Tensor, Any], writer: Any, step: int) -> None:
        """Originals (top row) over their reconstructions (bottom row), one grey image."""
        x = batch[0][: self.num_images]
        recon = model(x)[0].reshape(x.shape)
        rows = [torch.cat(list(r[:, 0]), dim=1) for r in (x, recon)]  # (H, k*W) each: first channel
        grid = torch.cat(rows, dim=0).float()
        grid = (grid - grid.min()) / (grid.max() - grid.min() + 1e-8)
        writer.image("val/reconstructions", grid[None].cpu(), step)
