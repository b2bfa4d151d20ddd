"""A plain multilayer perceptron over flattened images."""

from __future__ import annotations

from torch import Tensor, nn


class MLP(nn.Module):
    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: int = 8,
        hidden: list[int] = (256, 256),
        dropout: float = 0.1,
    ):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_channels * image_size * image_size
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
