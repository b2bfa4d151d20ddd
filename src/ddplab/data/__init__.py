"""Datasets, samplers and loaders. Nothing here knows about Hydra."""

from ddplab.data.datasets import Splits, TensorData, digits, synthetic
from ddplab.data.augment import BatchAugment
from ddplab.data.loaders import TrainLoader, eval_batches, on_device, to_device
from ddplab.data.sampling import ShardedGlobalSampler, eval_shard

__all__ = ["Splits", "TensorData", "digits", "synthetic", "TrainLoader", "eval_batches", "on_device", "to_device", "BatchAugment",
           "ShardedGlobalSampler", "eval_shard"]
