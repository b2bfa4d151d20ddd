"""Typed config: schemas Hydra merges ``conf/`` over, their registration, and validation.

* :mod:`.choices` — the enums of every choice field (unknown options fail while composing);
* :mod:`.schema` — TrainConfig and its distributed / perf / checkpoint parts (defaults live here);
* :mod:`.groups` — schemas of the model / dataset / optimizer / scheduler options;
* :mod:`.validate` — each schema's range checks plus the rules spanning keys.

``train.py`` calls :func:`register_configs` before ``@hydra.main`` composes.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ddplab import rundir
from ddplab.config.errors import ConfigError, InputError
from ddplab.config.groups import GROUPS
from ddplab.config.schema import TrainConfig
from ddplab.config.system import DistributedConfig
from ddplab.config.validate import validate

__all__ = ["ConfigError", "InputError", "register_configs", "validate"]
_REGISTERED = False


def register_configs() -> None:
    """Make the schemas visible to conf/'s defaults lists; idempotent.

    Registers ``train_schema`` and ``schema/<group>/<name>``, the ``lt``
    resolver that conf/model/resnet*.yaml uses for ``small_input``, and ``fresh_dir``
    (conf/train.yaml's default run and sweep dirs).
    """
    global _REGISTERED
    cs = ConfigStore.instance()
    if _REGISTERED and "train_schema.yaml" in cs.repo:  # storing converts every schema again: a tenth of a
        return  # job's start (a multirun's every job); a store emptied since is filled again
    _REGISTERED = True
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="schema/distributed", name="distributed", node=DistributedConfig)
    for group, schemas in GROUPS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
    if not OmegaConf.has_resolver("lt"):
        OmegaConf.register_new_resolver("lt", lambda a, b: a < b)
    if not OmegaConf.has_resolver("fresh_dir"):  # Hydra's dated run/sweep dirs, one per job (conf/train.yaml)
        OmegaConf.register_new_resolver("fresh_dir", rundir.fresh_dir, use_cache=True)
