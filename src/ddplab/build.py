"""Building a job's parts from its config — the only place that calls Hydra's ``instantiate``
on the model and dataset groups: the dataset's splits + augmentation, and the model with
``model.weights`` loaded. Wrapping and placement belong to the strategy."""

from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddplab.data import BatchAugment, Splits


def dataset(cfg: DictConfig) -> tuple[Splits, BatchAugment | None]:
    """The dataset factory's splits, and the augmentation its config asks for.

    ``augment`` is applied by the loader, batched on the device; the factory never sees it.
    """
    spec = OmegaConf.to_container(cfg.dataset, resolve=True, enum_to_str=True)
    aug = spec.pop("augment", None)
    return instantiate(spec, _convert_="all"), (BatchAugment(**aug) if aug else None)


def model(cfg: DictConfig) -> nn.Module:
    """The model factory's module, with ``model.weights`` (a local file) loaded into it."""
    spec = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True)
    weights = spec.pop("weights", None)
    module = instantiate(spec, _convert_="all")
    if weights:
        from ddplab.models.weights import load_weights

        load_weights(module, weights)
    return module
