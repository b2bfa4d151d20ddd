"""Models as plain nn.Modules; constructor arguments are the config keys."""

from ddplab.models.convnet import ConvNet
from ddplab.models.gpt import TinyGPT
from ddplab.models.mlp import MLP
from ddplab.models.resnet import ResNet, resnet18, resnet34, resnet50
from ddplab.models.vae import VAE
from ddplab.models.vit import VisionTransformer
from ddplab.models.weights import load_weights

__all__ = [
    "ConvNet",
    "MLP",
    "ResNet",
    "resnet18",
    "resnet34",
    "resnet50",
    "VisionTransformer",
    "load_weights",
    "TinyGPT",
    "VAE",
]
