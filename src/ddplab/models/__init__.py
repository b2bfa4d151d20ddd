"""Models as plain nn.Modules; constructor arguments are the config keys."""

from ddplab.models.convnet import ConvNet
from ddplab.models.mlp import MLP
from ddplab.models.resnet import ResNet, resnet18, resnet34, resnet50

__all__ = ["ConvNet", "MLP", "ResNet", "resnet18", "resnet34", "resnet50"]
