"""The small BatchNorm + dropout convnet of the Keras multi-GPU guide, in torch.

Keras: Conv(12, 3, same, no bias) → BN → ReLU → Conv(24, 6, stride 2, no bias)
→ BN → ReLU → Conv(32, 6, same, stride 2) → BN → ReLU → global average pool →
Dense(256, relu) → Dropout(0.5) → Dense(10). The stride-2 convs use "same"
padding here so the net also works on 8x8 digits (Keras' "valid" would shrink
an 8x8 map to 2x2 after one layer). Input scaling is done by the dataset.
"""

from __future__ import annotations

from torch import Tensor, nn


class ConvNet(nn.Module):
    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        channels: list[int] = (12, 24, 32),
        hidden: int = 256,
        dropout: float = 0.5,
    ):
        super().__init__()
        c1, c2, c3 = channels
        # BatchNorm right after a conv makes the conv's bias redundant.
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, 3, padding=1, bias=False),
            nn.BatchNorm2d(c1),
            nn.ReLU(inplace=True),
            nn.Conv2d(c1, c2, 6, stride=2, padding=2, bias=False),
            nn.BatchNorm2d(c2),
            nn.ReLU(inplace=True),
            nn.Conv2d(c2, c3, 6, stride=2, padding=2),
            nn.BatchNorm2d(c3),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(
            nn.Linear(c3, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
