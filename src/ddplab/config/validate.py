"""``validate(cfg)``: every schema's own range checks, then the rules that span keys.

Runs on every rank before any process group exists. Typed choices are not
checked here: OmegaConf rejects an unknown option while Hydra composes.
Strategy-specific refusals (fsdp + compile, dp under torchrun) belong to the
strategy classes (:func:`ddplab.strategy.check_launch`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from ddplab.config.datasets import AugmentConfig
from ddplab.config.errors import ConfigError, require

# The order the checks run in (the first problem found is the one said): the run's own keys, then each part.
_ORDER = (
    "",
    "distributed",
    "perf",
    "checkpoint",
    "verify",
    "study",
    "mlflow",
    "wandb",
    "model",
    "dataset",
    "optimizer",
    "scheduler",
    "task",
)


def validate(cfg: DictConfig) -> None:
    """Range and cross-key checks; raises ConfigError naming the key, the value and the fix."""
    try:  # an interpolation that cannot resolve (model.num_classes: ${dataset.num_classes} on a text dataset)
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as e:
        why = str(e.msg).splitlines()[0]
        raise ConfigError(
            f"{e.full_key}: {why}. Fix: give {e.full_key} a value, or choose options that fit "
            "together (task=lm goes with dataset=text model=gpt)"
        ) from None
    nodes = {key: cfg.get(key) if key else cfg for key in _ORDER}
    nodes.update({f"callbacks.{name}": node for name, node in (cfg.get("callbacks") or {}).items()})
    # each node's check is its schema's (every config arrives typed: config.typed)
    for key, node in nodes.items():
        if isinstance(node, DictConfig) and hasattr(OmegaConf.get_type(node), "check"):
            OmegaConf.get_type(node).check(node, key)
    _any_option_keys(cfg)
    pf, d = cfg.perf, cfg.distributed
    require(
        not pf.compile or d.bucket_cap_mb >= 1,
        "distributed.bucket_cap_mb",
        d.bucket_cap_mb,
        "with perf.compile=true buckets must hold at least DDP's 1 MB first bucket (dynamo splits the graph "
        "at bucket boundaries)",
        "pass distributed.bucket_cap_mb=25, or perf.compile=false",
    )


def _any_option_keys(cfg: DictConfig) -> None:
    """Keys that a group option of any origin (ours or a user's yaml) may carry."""
    ds = cfg.dataset if isinstance(cfg.dataset, DictConfig) else {}
    if ds.get("augment") is not None:
        AugmentConfig.check(ds.augment, "dataset.augment")
        size = ds.get("image_size")
        # a crop window made mostly of padding trains on zeros (8x8 digits, padding 100: 6 % val acc)
        if size:
            require(
                2 * ds.augment.crop_padding < size,
                "dataset.augment.crop_padding",
                ds.augment.crop_padding,
                f"must be less than half of dataset.image_size={size}",
                f"pass dataset.augment.crop_padding={max(size // 8, 0)} (or 0: off)",
            )
    root = ds.get("root")
    require(
        root is not None or "root" not in ds,
        "dataset.root",
        root,
        f"{ds.get('_target_', 'this dataset')} reads local files (nothing is downloaded)",
        "dataset.root=/path/to/the/files (docs/data-and-models.md, 'Datasets', says which files and where to "
        "get them)",
    )
    if root:
        require(
            Path(root).exists(),
            "dataset.root",
            root,
            "no such file or directory (nothing is downloaded)",
            "point dataset.root at the folder that holds the dataset's files",
        )
    lr: Any = cfg.optimizer.get("lr") if isinstance(cfg.optimizer, DictConfig) else None
    if lr is not None:
        require(lr > 0, "optimizer.lr", lr, "must be > 0", "pass optimizer.lr=0.1")
