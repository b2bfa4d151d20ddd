"""Datasets, samplers and loaders. Nothing here knows about Hydra."""

from ddplab.data.augment import BatchAugment
from ddplab.data.datasets import Splits, TensorData, digits, synthetic
from ddplab.data.files import (
    DatasetFilesError,
    cifar10,
    cifar100,
    fashion_mnist,
    imagefolder,
    mnist,
    read_idx,
)
from ddplab.data.loaders import TrainLoader, eval_batches, on_device, to_device
from ddplab.data.sampling import ShardedGlobalSampler, eval_shard
from ddplab.data.tabular import diabetes, text
from ddplab.data.tokens import TokenFileError, token_shards, tokens, write_tokens

__all__ = [
    "Splits",
    "TensorData",
    "digits",
    "synthetic",
    "mnist",
    "fashion_mnist",
    "cifar10",
    "cifar100",
    "imagefolder",
    "read_idx",
    "DatasetFilesError",
    "TrainLoader",
    "eval_batches",
    "on_device",
    "to_device",
    "BatchAugment",
    "ShardedGlobalSampler",
    "eval_shard",
    "diabetes",
    "text",
    "tokens",
    "token_shards",
    "write_tokens",
    "TokenFileError",
]
