"""Datasets, samplers and loaders. Nothing here knows about Hydra."""

from ddplab.data.datasets import Splits, TensorData, digits, synthetic
from ddplab.data.loaders import TrainLoader, eval_batches
from ddplab.data.sampling import ShardedGlobalSampler, eval_shard

__all__ = ["Splits", "TensorData", "digits", "synthetic", "TrainLoader", "eval_batches",
           "ShardedGlobalSampler", "eval_shard"]
