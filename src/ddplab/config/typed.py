"""A config that arrives as plain data, typed by the schema again; and a typed config's resolved copy.

Hydra composes a typed config (each fixed node a schema's, each group option its own schema's where it has
one), and every check and use site reads it so: a default lives in the schema alone. A config also arrives
as plain data — one stored in a checkpoint (``mode=eval``), rank 0's received by the other ranks
when they differ, one a script hands over — and :func:`typed` puts it on the schema: a key it lacks (a config
an older ddplab stored) gets the schema's default, a value of the wrong type is refused in one line. A job
handed to self-launched ranks travels typed (:func:`resolved_copy`: pickled, it keeps its types).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from ddplab.config.errors import ConfigError
from ddplab.config.schema import TrainConfig

log = logging.getLogger("ddplab")


def is_typed(cfg: Any) -> bool:
    return isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is TrainConfig


def typed(plain: Any, where: str) -> DictConfig:
    """``plain`` (a dict, or a DictConfig without its schema) on TrainConfig; ``where`` names its origin in
    the one line a refused value gets. Keys the schema no longer has (a config from an older ddplab) are
    dropped with a warning that names them."""
    if is_typed(plain):
        return plain
    data = OmegaConf.to_container(plain, resolve=False) if isinstance(plain, DictConfig) else plain
    dropped = []
    while True:
        try:
            out = OmegaConf.merge(OmegaConf.structured(TrainConfig), data)
            break
        except ConfigKeyError as e:  # a key this schema does not have: not ours to guess at
            if not e.full_key or not _drop(data, e.full_key):
                raise ConfigError(f"{where}: {e.full_key}: {str(e.msg).splitlines()[0]}") from None
            dropped.append(e.full_key)
        except ValidationError as e:
            raise ConfigError(
                f"{where}: {e.full_key}={e.value!r}: {str(e.msg).splitlines()[0]}. Fix: a "
                f"config a ddplab run wrote, or {e.full_key}=<a valid value>"
            ) from None
    if dropped:
        log.warning("%s: keys this ddplab does not know, ignored: %s", where, ", ".join(dropped))
    OmegaConf.set_struct(out, True)
    return out


def _drop(data: dict[str, Any], dotted: str) -> bool:
    *parents, last = dotted.split(".")
    node: Any = data
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        return False
    del node[last]
    return True


def resolved_copy(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with every interpolation resolved (``${now:}``, ``${hydra:...}``: where Hydra's
    resolvers still work), its types kept: what self-launched ranks receive (pickled, it unpickles in ~2 ms
    where building a config from plain data takes ~20)."""
    out = pickle.loads(pickle.dumps(cfg))
    OmegaConf.resolve(out)
    OmegaConf.set_struct(out, True)
    return out
