"""Building a job's parts from its config — the only place that calls Hydra's ``instantiate``
on the model, dataset and task groups: the dataset's splits + augmentation, the model with
``model.weights`` loaded, the task. Wrapping and placement belong to the strategy."""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddplab.data import BatchAugment, Splits


def dataset(cfg: DictConfig) -> tuple[Splits, BatchAugment | None]:
    """The dataset factory's splits, and the augmentation its config asks for.

    ``augment`` is applied by the loader, batched on the device; the factory never sees it.
    A factory may return :class:`Splits`, a ``(train, val)`` pair of map-style datasets, or a
    dict with ``train``, ``val`` and optionally ``collate_fn``.
    """
    spec = OmegaConf.to_container(cfg.dataset, resolve=True, enum_to_str=True)
    aug = spec.pop("augment", None)
    return splits_of(instantiate(spec, _convert_="all"), spec.get("_target_")), (BatchAugment(**aug) if aug else None)


def splits_of(made: Any, target: Any) -> Splits:
    if isinstance(made, Splits):
        return made
    if isinstance(made, dict) and {"train", "val"} <= made.keys():
        return Splits(made["train"], made["val"], made.get("num_classes"), made.get("collate_fn"))
    if isinstance(made, (tuple, list)) and len(made) == 2:
        return Splits(made[0], made[1])
    raise TypeError(f"dataset._target_={target} returned {type(made).__name__}; a dataset factory returns "
                    "(train, val) map-style datasets, a dict with 'train', 'val' (and 'collate_fn'), or "
                    "ddplab.data.Splits. Fix: return (train_dataset, val_dataset)")


def task(cfg: DictConfig) -> Any:
    """The task object ``cfg.task`` names (a ``_target_`` class and its keyword arguments)."""
    spec = OmegaConf.to_container(cfg.task, resolve=True, enum_to_str=True)
    made = instantiate(spec, _convert_="all")
    if not callable(made):
        raise TypeError(f"task._target_={spec.get('_target_')} made a {type(made).__name__}, which cannot be "
                        "called on (model, batch). Fix: point it at a Task class (see ddplab.task)")
    return made


def model(cfg: DictConfig) -> nn.Module:
    """The model factory's module, with ``model.weights`` (a local file) loaded into it."""
    spec = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True)
    weights = spec.pop("weights", None)
    module = instantiate(spec, _convert_="all")
    if weights:
        from ddplab.models.weights import load_weights

        load_weights(module, weights)
    return module
