"""Schemas of the config groups whose options name a ``_target_`` factory:
model (models.py), dataset (datasets.py), optimizer, scheduler (optimization.py), task and callbacks
(task_and_callbacks.py): the table of each group's options.

Defaults live here, once; an option's yaml (conf/<group>/<option>.yaml) only
picks a schema and sets what differs for that option (its ``_target_``,
interpolations from the dataset). A user can point a group at any installed
factory with a yaml of their own, with or without one of these schemas.
"""

from __future__ import annotations

from ddplab.config.datasets import (
    CIFARConfig,
    DiabetesConfig,
    DigitsConfig,
    HFDataConfig,
    ImageFolderConfig,
    MNISTConfig,
    SyntheticConfig,
    TextConfig,
    TokensConfig,
    TokenShardsConfig,
)
from ddplab.config.models import (
    ConvNetConfig,
    GPTConfig,
    HFModelConfig,
    KerasConvNetConfig,
    MLPConfig,
    ResNetConfig,
    VAEConfig,
    ViTConfig,
)
from ddplab.config.optimization import AdamWConfig, ConstantConfig, CosineConfig, SGDConfig, StepConfig
from ddplab.config.task_and_callbacks import (
    ClassificationTaskConfig,
    EarlyStoppingConfig,
    EMAConfig,
    LanguageModelTaskConfig,
    ProfilerConfig,
    RegressionTaskConfig,
    SamplesConfig,
    VAETaskConfig,
)

GROUPS = {
    "model": {
        "resnet": ResNetConfig,
        "convnet": ConvNetConfig,
        "mlp": MLPConfig,
        "vit": ViTConfig,
        "keras_convnet": KerasConvNetConfig,
        "vae": VAEConfig,
        "gpt": GPTConfig,
        "hf": HFModelConfig,
    },
    "dataset": {
        "digits": DigitsConfig,
        "synthetic": SyntheticConfig,
        "mnist": MNISTConfig,
        "cifar": CIFARConfig,
        "imagefolder": ImageFolderConfig,
        "diabetes": DiabetesConfig,
        "text": TextConfig,
        "tokens": TokensConfig,
        "token_shards": TokenShardsConfig,
        "hf": HFDataConfig,
    },
    "optimizer": {"sgd": SGDConfig, "adamw": AdamWConfig},
    "scheduler": {"cosine": CosineConfig, "step": StepConfig, "constant": ConstantConfig},
    "task": {
        "classification": ClassificationTaskConfig,
        "regression": RegressionTaskConfig,
        "lm": LanguageModelTaskConfig,
        "vae": VAETaskConfig,
    },
    "callbacks": {
        "ema": EMAConfig,
        "early_stopping": EarlyStoppingConfig,
        "profiler": ProfilerConfig,
        "samples": SamplesConfig,
    },
}
