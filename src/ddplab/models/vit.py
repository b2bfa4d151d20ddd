"""A Vision Transformer with torchvision's module layout (state_dict keys match
``torchvision.models.VisionTransformer``: ``conv_proj``, ``class_token``,
``encoder.layers.encoder_layer_N.{ln_1,self_attention,ln_2,mlp}``, ``heads.head``).

``conf/model/vit.yaml`` is a small one for 8x8..32x32 images on a CPU; with
``patch_size=16, num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072`` on
224x224 images it is ViT-B/16, and torchvision's weights load with
``model.weights=path``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn


class EncoderBlock(nn.Module):
    """Pre-norm block: x + attention(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(
        self, num_heads: int, hidden_dim: int, mlp_dim: int, dropout: float, attention_dropout: float
    ):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(
            hidden_dim, num_heads, dropout=attention_dropout, batch_first=True
        )
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden_dim, eps=1e-6)
        # Indices 0 and 3 hold the weights, as in torchvision's MLPBlock.
        self.mlp = nn.Sequential(
            nn.Linear(hidden_dim, mlp_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp_dim, hidden_dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + self.dropout(y)
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(
        self,
        seq_length: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        mlp_dim: int,
        dropout: float,
        attention_dropout: float,
    ):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(
            OrderedDict(
                (
                    f"encoder_layer_{i}",
                    EncoderBlock(num_heads, hidden_dim, mlp_dim, dropout, attention_dropout),
                )
                for i in range(num_layers)
            )
        )
        self.ln = nn.LayerNorm(hidden_dim, eps=1e-6)

    def forward(self, x: Tensor) -> Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VisionTransformer(nn.Module):
    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 4,
        num_layers: int = 4,
        num_heads: int = 4,
        hidden_dim: int = 128,
        mlp_dim: int = 256,
        num_classes: int = 10,
        in_channels: int = 3,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
    ):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(
                f"model.patch_size={patch_size} does not divide dataset.image_size={image_size}. "
                f"Fix: a patch size that divides it, e.g. model.patch_size={_divisor(image_size)}"
            )
        if hidden_dim % num_heads:
            raise ValueError(f"model.hidden_dim={hidden_dim} is not divisible by model.num_heads={num_heads}")
        self.patch_size, self.hidden_dim = patch_size, hidden_dim
        self.conv_proj = nn.Conv2d(in_channels, hidden_dim, kernel_size=patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        seq_length = (image_size // patch_size) ** 2 + 1
        self.encoder = Encoder(
            seq_length, num_layers, num_heads, hidden_dim, mlp_dim, dropout, attention_dropout
        )
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(hidden_dim, num_classes)))
        # torchvision's init: fan-in scaled patch projection, zero head.
        fan_in = in_channels * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=(1.0 / fan_in) ** 0.5)
        nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(self.heads.head.weight)
        nn.init.zeros_(self.heads.head.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)  # (N, patches, hidden)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


def _divisor(n: int) -> int:
    return next(p for p in (4, 2, 8, 16, 1) if n % p == 0)
