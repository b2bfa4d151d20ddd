"""A small fully connected variational autoencoder over flattened images (task=vae)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class VAE(nn.Module):
    """x → (reconstruction shaped like x, mu, logvar); samples z in training, uses mu in eval."""

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 8,
        hidden: int = 128,
        latent: int = 8,
        num_classes: int | None = None,
    ):
        super().__init__()  # num_classes: accepted so dataset interpolations fit; a VAE has no classes
        width = in_channels * image_size * image_size
        self.encoder = nn.Sequential(
            nn.Flatten(), nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 2 * latent)
        )
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, width))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mu, logvar = self.encoder(x).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp() if self.training else mu
        return self.decoder(z).reshape(x.shape), mu, logvar
